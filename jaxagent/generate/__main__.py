"""`python -m jaxagent.generate "question" [--model PATH] [--max-new-tokens N] [--temperature T]`.

Chat with a model from the command line: renders the chat template, samples a reply.
"""
import argparse

from jaxagent import models
from jaxagent.generate import generate


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m jaxagent.generate", description=__doc__)
  ap.add_argument("prompt", nargs="?", default="What is the capital of France?")
  ap.add_argument("--model", default="smollm2-135m-instruct",
                  help="HF directory, .gguf file or embedded preset")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  cfg, params = models.load(args.model)
  tok = models.load_tokenizer(args.model)
  text = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                 add_generation_prompt=True)
  out = generate(params, cfg, [tok.encode(text)], args.max_new_tokens, tokenizer=tok,
                 temperature=args.temperature, seed=args.seed, slots=1)[0]
  reply = tok.decode(out.tokens, skip_special_tokens=True)
  print(f"user: {args.prompt}\nassistant: {reply}\n[{len(out.tokens)} tokens, "
        f"stop: {out.stop_reason}]")


if __name__ == "__main__":
  main()
