"""`python -m jaxagent.generate "question" [--model PATH] [--max-new-tokens N] [--temperature T]
[--top-p P] [--top-k K] [--stop STRING ...] [--seed S]`.

Chat with a model from the command line: renders the chat template, samples a reply.
A bad flag, model or prompt is a one-line error and exit status 2 (flags) or 1 (the rest).
"""
import argparse
import math

from jaxagent import models
from jaxagent.generate import generate
from jaxagent.generate.sampling import MIN_TEMPERATURE


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m jaxagent.generate", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("prompt", nargs="?", default="What is the capital of France?",
                  help="the user message (default: %(default)r)")
  ap.add_argument("--model", default="smollm2-135m-instruct",
                  help="HF directory, .gguf file or embedded preset (default: %(default)s)")
  ap.add_argument("--max-new-tokens", type=int, default=64, help="reply budget, >= 1")
  ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else > 0")
  ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
  ap.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 = off")
  ap.add_argument("--stop", action="append", default=None, metavar="STRING",
                  help="end the reply at this string (repeatable)")
  ap.add_argument("--seed", type=int, default=0, help="sampling seed in [0, 2**32)")
  return ap


def main(argv=None):
  ap = _parser()
  args = ap.parse_args(argv)
  if not 1 <= args.max_new_tokens < 2 ** 31:  # the engine counts budgets in int32
    ap.error(f"--max-new-tokens must be >= 1 and below 2**31, got {args.max_new_tokens}")
  if not (math.isfinite(args.temperature) and args.temperature >= 0):
    ap.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
  if 0 < args.temperature < MIN_TEMPERATURE:
    ap.error(f"--temperature {args.temperature} is below {MIN_TEMPERATURE}, where logits / "
             "temperature overflow; use 0 for greedy decoding")
  if not 0.0 < args.top_p <= 1.0:  # also false for nan
    ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
  if args.top_k < 0:
    ap.error(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
  if not 0 <= args.seed < 2 ** 32:  # refused by the sampler only after the model had loaded
    ap.error(f"--seed must be in [0, 2**32), got {args.seed}")
  if args.stop is not None and not all(args.stop):
    ap.error("--stop strings must be non-empty")
  for name, text in [("prompt", args.prompt)] + [("--stop", s) for s in args.stop or []]:
    try:
      text.encode("utf-8")
    except UnicodeEncodeError:  # bytes the terminal's locale could not decode
      ap.error(f"the {name} {text!r} is not valid UTF-8 text")
  try:
    cfg, params = models.load(args.model)
    tok = models.load_tokenizer(args.model)
    prompt = tok.encode_chat([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    if prompt and max(prompt) >= cfg.vocab_size:  # the engine's own error named neither file nor cause
      raise ValueError(f"the tokenizer of {args.model} ({tok.vocab_size} ids) encodes the prompt "
                       f"with token id {max(prompt)}, outside the model's vocabulary of "
                       f"{cfg.vocab_size}: the tokenizer files do not belong to these weights")
    if len(prompt) + 1 > cfg.max_seq_len:
      raise ValueError(f"the prompt is {len(prompt)} tokens with its chat template; {args.model} "
                       f"takes at most {cfg.max_seq_len} (prompt plus one new token): shorten it")
    out = generate(params, cfg, [prompt], args.max_new_tokens, tokenizer=tok,
                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                   stop=args.stop, seed=args.seed, slots=1)[0]
  except (OSError, ValueError) as e:  # a missing or unusable model, a bad prompt
    raise SystemExit(f"generate failed: {e}") from None
  reply = tok.decode(out.tokens, skip_special_tokens=True)
  print(f"user: {args.prompt}\nassistant: {reply}\n[{len(out.tokens)} tokens, "
        f"stop: {out.stop_reason}]")


if __name__ == "__main__":
  main()
