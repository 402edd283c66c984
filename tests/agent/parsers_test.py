"""Tool-call parsers: the conventions, precise malformed-call messages, and fuzzing (never raise)."""
import json
import math
import time

import pytest

from jaxagent.agent import JSONToolCallParser, ParseResult, Parser, ToolCall, XMLTagParser

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

XML = XMLTagParser({"search": ("search", "query"), "code": ("python", "code"),
                    "calc": ("calculator", "expression")}, answer_tag="answer")
JSON = JSONToolCallParser()
JSON_ANS = JSONToolCallParser(answer_tag="answer")


def test_parsers_satisfy_the_protocol_and_list_stop_strings():
  assert isinstance(XML, Parser) and isinstance(JSON, Parser)
  assert XML.stop_strings() == ["</search>", "</code>", "</calc>", "</answer>"]
  assert JSON.stop_strings() == ["</tool_call>"]
  assert JSON_ANS.stop_strings() == ["</tool_call>", "</answer>"]


# ----------------------------------------------------------------------------------- XML


@pytest.mark.parametrize("text,kind,expect", [
    ("I should look it up. <search> capital of France </search>", "tool_call",
     ToolCall("search", {"query": "capital of France"}, "<search> capital of France </search>")),
    ("<code>\nx = 1\nprint(x)\n</code>\n  ", "tool_call",
     ToolCall("python", {"code": "x = 1\nprint(x)"}, "<code>\nx = 1\nprint(x)\n</code>")),
    ("<search>old</search> then <calc>2+2</calc>", "tool_call",
     ToolCall("calculator", {"expression": "2+2"}, "<calc>2+2</calc>")),
    # An opening tag inside a body is body text: a block opens at the first tag after the last block.
    ("<search>a <search>b</search>", "tool_call",
     ToolCall("search", {"query": "a <search>b"}, "<search>a <search>b</search>")),
    ("So <answer> Paris </answer>", "answer", "Paris"),
    ("<answer></answer>", "answer", ""),
    ("just thinking out loud", "text", None),
    ("<search>q</search> and then more words", "text", None),  # the block is not at the end
    ("", "text", None),
])
def test_xml_parses_the_last_block_at_the_end(text, kind, expect):
  r = XML.parse(text)
  assert r.kind == kind
  if kind == "tool_call":
    assert r.call == expect
  elif kind == "answer":
    assert r.answer == expect


@pytest.mark.parametrize("text,kind,expect", [
    # An opening tag written inside a body is body text. The last opening tag before the close was
    # taken as the block's start: the program below ran as '"\nprint(s)', a syntax error.
    ('<code>s = "<code>"\nprint(s)</code>', "tool_call", 's = "<code>"\nprint(s)'),
    ('<code>a</code> text <code>s = "<code>"</code>', "tool_call", 's = "<code>"'),
    ("<code>a</code> text <code>b</code>", "tool_call", "b"),  # earlier blocks stay history
    # The first block to open hides what it holds, of whatever tag.
    ("<search>what does <code> mean</search> <code>print(1)</code>", "tool_call", "print(1)"),
    ('<code>print("<answer>")</code> <answer>42</answer>', "answer", "42"),
    ('<code>print("<answer>")</code> so', "text", None),
    ("<code>x = '<search>'</code> <search>q</search>", "tool_call", "q"),
    ("<search>q <code>print(1)</code>", "tool_call", "print(1)"),  # an unclosed tag is no block
    # An answer is read from its last opening tag, as the reward's extract_tagged reads it.
    ("<answer>I think <answer>42</answer>", "answer", "42"),
    ("<code>a <answer>b</code></answer>", "malformed", "unbalanced <answer> tags"),
])
def test_xml_opening_tags_inside_a_body_are_body_text(text, kind, expect):
  r = XML.parse(text)
  assert r.kind == kind, r
  if kind == "tool_call":
    assert list(r.call.arguments.values()) == [expect]
  elif kind == "answer":
    assert r.answer == expect
  elif kind == "malformed":
    assert expect in r.error


@pytest.mark.parametrize("text,message", [
    ("<search>unfinished", "<search> was opened but never closed"),
    ("no opening</calc>", "</calc> has no matching <calc>"),
    ("<calc>   </calc>", "empty <calc></calc> block: put the expression for calculator inside"),
    ("<search>a</search>b</search>", "unbalanced <search> tags"),
])
def test_xml_malformed_calls_have_messages_for_the_model(text, message):
  r = XML.parse(text)
  assert r.kind == "malformed" and message in r.error and r.call is None


def test_xml_config_errors():
  with pytest.raises(ValueError, match="bare tag name"):
    XMLTagParser({"se arch": ("search", "query")})
  with pytest.raises(ValueError, match=r"\(tool name, argument name\)"):
    XMLTagParser({"search": "search"})
  with pytest.raises(ValueError, match="both a tool tag and the answer tag"):
    XMLTagParser({"answer": ("a", "b")})
  with pytest.raises(ValueError, match="at least one"):
    XMLTagParser({}, answer_tag=None)


# ----------------------------------------------------------------------------------- JSON


def test_json_tool_calls():
  text = 'ok\n<tool_call>\n  {"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>\n'
  r = JSON.parse(text)
  assert r.kind == "tool_call"
  assert r.call.name == "calculator" and r.call.arguments == {"expression": "6*7"}
  assert r.call.raw.startswith("<tool_call>") and r.call.raw.endswith("</tool_call>")
  # OpenAI style string arguments, missing and null arguments.
  r = JSON.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>')
  assert r.call.arguments == {"a": [1, 2]}
  assert JSON.parse('<tool_call>{"name": " f "}</tool_call>').call == ToolCall("f", {}, '<tool_call>{"name": " f "}</tool_call>')
  assert JSON.parse('<tool_call>{"name": "f", "arguments": null}</tool_call>').call.arguments == {}
  # Only the last call counts; an answer tag when configured.
  r = JSON.parse('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>')
  assert r.call.name == "b"
  assert JSON_ANS.parse("<answer> 42 </answer>").answer == "42"
  assert JSON.parse("The answer is 42.").kind == "text"
  assert JSON.parse("<answer>42</answer>").kind == "text"  # no answer tag configured


@pytest.mark.parametrize("body,message", [
    ('{"name": "f", "arguments": {"a": 1}', "invalid JSON in <tool_call>: Expecting ',' delimiter at line 1 column 36"),
    ("{'name': 'f'}", "invalid JSON in <tool_call>: Expecting property name enclosed in double quotes at line 1"),
    ('["f", {}]', "must be a JSON object with \"name\" and \"arguments\", got a JSON array"),
    ('"f"', "got a JSON string"),
    ('{"arguments": {}}', 'the call has no "name"'),
    ('{"name": 3}', '"name" must be a non-empty string'),
    ('{"name": "  "}', '"name" must be a non-empty string'),
    ('{"name": "f", "arguments": [1]}', '"arguments" must be a JSON object, got a JSON array'),
    ('{"name": "f", "arguments": "x"}', '"arguments" is a string but not a JSON object'),
    ('{"name": "f", "arguments": "[1]"}', '"arguments" must be a JSON object, got a JSON array'),
    ("", "empty <tool_call> block"),
    ("1" * 5000, "invalid JSON in <tool_call>: ValueError"),       # over Python's int-digit limit
    ("[" * 100_000 + "]" * 100_000, "invalid JSON in <tool_call>"),  # deeper than the recursion limit
])
def test_json_malformed_calls_are_precise(body, message):
  r = JSON.parse(f"<tool_call>{body}</tool_call>")
  assert r.kind == "malformed" and message in r.error, r.error


def test_json_tool_call_tag_inside_a_string_argument():
  """`<tool_call>` quoted in an argument was taken as the block's start: invalid JSON."""
  call = {"name": "write", "arguments": {"text": "wrap calls in <tool_call> tags"}}
  r = JSON.parse(f"<tool_call>{json.dumps(call)}</tool_call>")
  assert r.kind == "tool_call" and r.call.arguments == call["arguments"], r
  r = JSON_ANS.parse('<tool_call>{"name": "a"}</tool_call> <answer>x <tool_call> y</answer>')
  assert r.kind == "answer" and r.answer == "x <tool_call> y"
  r = JSON_ANS.parse("<answer>1</answer></answer>")
  assert r.kind == "malformed" and "unbalanced <answer> tags" in r.error


def test_json_unclosed_and_stray_tags():
  assert "opened but never closed" in JSON.parse('<tool_call>{"name": "f"').error
  assert "has no matching <tool_call>" in JSON.parse('{"name": "f"}</tool_call>').error


def test_parse_result_invariants():
  with pytest.raises(ValueError):
    ParseResult("tool_call")
  with pytest.raises(ValueError):
    ParseResult("malformed")
  with pytest.raises(ValueError):
    ParseResult("bogus")


def _best_seconds(fn, limit: float) -> float:
  """The best time of up to three calls of `fn`, stopping at the first under `limit`: a test
  process kept off the CPU for a while by the other one (once 1.95 s for a 0.02 s parse in CI)
  is no quadratic parse, which is slow every time."""
  best = math.inf
  for _ in range(3):
    t = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t)
    if best < limit:
      break
  return best


def test_huge_inputs_parse_quickly():
  blob = ("<search>" + "x" * 1000 + "</calc>\n") * 2000 + "<code>print(1)</code>"
  t = time.perf_counter()
  for p in (XML, JSON, JSON_ANS):
    p.parse(blob)
    p.parse("<" * 1_000_000)
    p.parse("</tool_call>" * 100_000)
  assert XML.parse(blob).call == ToolCall("python", {"code": "print(1)"}, "<code>print(1)</code>")
  assert time.perf_counter() - t < 5.0


def test_parsing_is_linear_with_many_tags_before_and_after():
  """200 KB of tags left open, closed pairs and tags inside a body parse in milliseconds."""
  body = 's = "<code>"\n' * 15000
  for text, expect in [("<code>" * 30000 + "x</code>", "<code>" * 29999 + "x"),
                       ("<code>a</code> " * 14000 + "<code>b</code>", "b"),
                       ("<search>q<answer>" * 12000 + "<code>x</code>", "x"),
                       ("</code>" * 25000 + "<code>x</code>", None),
                       (f"<code>{body}</code>", body.strip())]:
    assert _best_seconds(lambda: XML.parse(text), 0.5) < 0.5, text[:20]
    if expect is not None:
      assert XML.parse(text).call.arguments == {"code": expect}
  for text in ("<tool_call>" * 20000 + '{"name": "f"}</tool_call>', "<answer>a</answer>" * 12000):
    assert _best_seconds(lambda: JSON_ANS.parse(text), 0.5) < 0.5, text[:20]


# ----------------------------------------------------------------------------------- fuzzing

# Any code point, lone surrogates included (they are also spliced in explicitly, being rare here).
_chars = st.characters(blacklist_categories=())
_tags = ["<search>", "</search>", "<code>", "</code>", "<calc>", "</calc>", "<answer>", "</answer>",
         "<tool_call>", "</tool_call>", "<", ">", "</", "{", "}", '"name"', '"arguments"', ":", ",", "[",
         "]", '"', "\\", "\\u", "\\ud800", "null", "true", "1e999", "NaN", "-", "\n", " ",
         "\ud800", "\udfff", "\ud83d\ude00", "\x00", "\ufffd"]
_pieces = st.one_of(st.text(_chars, max_size=20), st.sampled_from(_tags))
_model_text = st.lists(_pieces, max_size=40).map("".join)

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(_chars, max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(_chars, max_size=8), children,
                                                                       max_size=4),
    max_leaves=12)


def _valid_result(r):
  assert isinstance(r, ParseResult) and r.kind in ("tool_call", "answer", "text", "malformed")
  if r.kind == "tool_call":
    assert isinstance(r.call.name, str) and r.call.name and isinstance(r.call.arguments, dict)
  if r.kind == "malformed":
    assert isinstance(r.error, str) and r.error


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(text=_model_text)
def test_fuzz_model_text_never_raises(text):
  for p in (XML, JSON, JSON_ANS):
    r = p.parse(text)
    _valid_result(r)
    assert p.parse(text) == r  # deterministic


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(name=st.text(_chars, min_size=1, max_size=12), args=st.dictionaries(
    st.text(_chars, max_size=8), _json, max_size=4), cut=st.integers(0, 10_000),
    junk=st.text(_chars, max_size=5), data=st.data())
def test_fuzz_mutated_json_calls(name, args, cut, junk, data):
  body = json.dumps({"name": name, "arguments": args}, ensure_ascii=data.draw(st.booleans()))
  text = f"<tool_call>{body}</tool_call>"
  r = JSON.parse(text)
  if name.strip() and "</tool_call>" not in body:
    assert r.kind == "tool_call" and r.call.name == name.strip() and r.call.arguments == args
  # Truncated, spliced and nested variants never raise.
  cut %= len(text) + 1
  for variant in (text[:cut], text[:cut] + junk + text[cut:], "<tool_call>" + text,
                  text.replace("}", "", 1), text + "</tool_call>", text[cut:]):
    _valid_result(JSON.parse(variant))
    _valid_result(JSON_ANS.parse(variant))


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(body=st.text(_chars, max_size=50), tag=st.sampled_from(["search", "code", "calc"]))
def test_fuzz_xml_round_trip(body, tag):
  r = XML.parse(f"thinking <{tag}>{body}</{tag}>")
  _valid_result(r)
  if "<" not in body and ">" not in body and body.strip():
    assert r.kind == "tool_call" and list(r.call.arguments.values()) == [body.strip()]


# ----------------------------------------------------------------------------------- think blocks

THINK = XMLTagParser({"code": ("python", "code"), "search": ("search", "query")}, answer_tag="answer",
                     think_tag="think")


@pytest.mark.parametrize("text,kind,expect", [
    # What is written while thinking is not an action (it was read as one).
    ("<think>maybe <answer>41</answer></think>", "text", None),
    ("<think>I could run <code>print(1)</code></think>", "text", None),
    ("<think>I could run <code>print(1)</code>", "text", None),  # never closed: hides the call
    ("<think>maybe <answer>41</answer></think> no: <answer>42</answer>", "answer", "42"),
    ("<think>run <code>print(1)</code>?</think>\n<code>print(2)</code>", "tool_call",
     ToolCall("python", {"code": "print(2)"}, "<code>print(2)</code>")),
    ("<answer>4<think>or 5?</think>2</answer>", "answer", "42"),
    # A think block never closed runs to where an answer opens (as math_tool's reward reads it).
    ("<think>so it is <answer>42</answer>", "answer", "42"),
    # The first block to open hides what it holds: a <think> in a call's body is part of the call.
    ("<search>what is <think></search>", "tool_call",
     ToolCall("search", {"query": "what is <think>"}, "<search>what is <think></search>")),
    ("<think>x</think><code>print(1)", "malformed", "<code> was opened but never closed"),
])
def test_xml_think_tag_hides_what_is_written_while_thinking(text, kind, expect):
  r = THINK.parse(text)
  assert r.kind == kind, r
  if kind == "answer":
    assert r.answer == expect
  elif kind == "tool_call":
    assert r.call == expect
  elif kind == "malformed":
    assert expect in r.error


@pytest.mark.parametrize("text,allowed", [
    ("<think>maybe <answer>41</answer>", False),
    ("<think>I could run <code>print(1)</code>", False),
    ("<think>a</think>\n<answer>41</answer>", True),
    ("<think>a <answer>4</answer> b</think> <answer>5</answer>", True),
    ("<code>print('<think>')</code>", True),  # a <think> quoted in code opens no block
    ("<answer>42</answer>", True),
])
def test_xml_think_tag_stop_allowed(text, allowed):
  assert THINK.stop_allowed(text) is allowed


def test_xml_without_think_tag_is_unchanged():
  assert XML.think_tag is None
  for text in ("<think>maybe <answer>41</answer>", "<think>run <code>print(1)</code>"):
    assert XML.stop_allowed(text)
  assert XML.parse("<think>maybe <answer>41</answer>").answer == "41"
  assert XML.parse("<think>run <code>print(1)</code>").call.arguments == {"code": "print(1)"}


JSON_THINK = JSONToolCallParser(answer_tag="answer", think_tag="think")
_CALL = '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'


@pytest.mark.parametrize("text,kind", [
    # A Qwen3-style reasoning block: the call it names is not made (it was run).
    (f"<think>I will call {_CALL} later</think>", "text"),
    (f"<think>first {_CALL}", "text"),  # never closed: hides the call
    (f"<think>plan</think>\n{_CALL}", "tool_call"),
    ("<think>maybe <answer>41</answer></think> <answer>42</answer>", "answer"),
    # The first block to open hides what it holds: a <think> in a call's JSON string is data.
    ('<tool_call>{"name": "calc", "arguments": {"x": "<think>"}}</tool_call>', "tool_call"),
])
def test_json_think_tag_hides_what_is_written_while_thinking(text, kind):
  r = JSON_THINK.parse(text)
  assert r.kind == kind, r
  if kind == "tool_call":
    assert r.call.name == "calc"
  if kind == "answer":
    assert r.answer == "42"
  assert JSON.parse(text).kind in ("tool_call", "text")  # without a think_tag: read as before
  assert JSON_THINK.stop_allowed(f"<think>I will call {_CALL}") is False
  assert JSON_THINK.stop_allowed(f"<think>a</think>{_CALL}") is True
  assert JSON_THINK.may_refuse_stops and not JSON.may_refuse_stops
  with pytest.raises(ValueError, match="think_tag 'tool_call' is also a tool tag"):
    JSONToolCallParser(think_tag="tool_call")


def test_xml_think_tag_config_errors():
  with pytest.raises(ValueError, match="think_tag 'code' is also a tool tag or the answer tag"):
    XMLTagParser({"code": ("python", "code")}, think_tag="code")
  with pytest.raises(ValueError, match="think_tag 'answer' is also"):
    XMLTagParser({"code": ("python", "code")}, think_tag="answer")
  with pytest.raises(ValueError, match="XMLTagParser.think_tag: tag '<think>' must be a bare tag"):
    XMLTagParser({"code": ("python", "code")}, think_tag="<think>")


def test_think_tag_parsing_is_linear_in_many_unclosed_tags():
  """A degenerate output of many tags left open took seconds per parse (a regex looked for each
  tag's close to the end of the text): 5 s for 8000 `<code>x<answer>`."""
  for blob in ("<code>x<answer>" * 8000, "<think>x<answer>" * 8000, "<code>x" * 15000,
               "<search>" * 20000 + "</think>"):  # about 0.02 s each on the 2-core machine
    best = _best_seconds(lambda: (THINK.parse(blob), THINK.stop_allowed(blob)), 1.0)
    assert best < 1.0, (blob[:20], best)
  assert THINK.parse("<code>x<answer>" * 3 + "4</answer>").answer == "4"
  assert not THINK.stop_allowed("<code>a</code>" * 5000 + "<think>" + "<code>x" * 5000 + "</code>")


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(text=st.lists(st.one_of(st.text(_chars, max_size=20), st.sampled_from(
    [*_tags, "<think>", "</think>"])), max_size=40).map("".join))
def test_fuzz_think_tag_never_raises(text):
  _valid_result(THINK.parse(text))
  assert THINK.stop_allowed(text) in (True, False)


@pytest.mark.parametrize("body,key", [
    ('{"name": "f", "parameters": {"x": 1}}', '"parameters"'),       # Llama-style key
    ('{"name": "f", "arguments": {}, "x": 1}', '"x"'),               # an argument outside them
    ('{"name": "f", "args": {"x": 1}, "arguments": {}}', '"args"'),
])
def test_json_call_with_a_key_besides_name_and_arguments_is_malformed(body, key):
  """A key other than "name" / "arguments" was dropped: the call ran without those arguments."""
  r = JSON.parse(f"<tool_call>{body}</tool_call>")
  assert r.kind == "malformed", r
  assert f"unexpected key(s) {key}" in r.error and '"arguments"' in r.error, r.error


def test_json_call_in_a_markdown_fence_says_so():
  r = JSON.parse('<tool_call>\n```json\n{"name": "f", "arguments": {}}\n```\n</tool_call>')
  assert r.kind == "malformed" and r.error.endswith("without a ``` fence"), r.error
  # Other invalid JSON does not mention a fence.
  assert "fence" not in JSON.parse('<tool_call>{"name": f}</tool_call>').error


@pytest.mark.parametrize("text", [
    # Qwen3 style: the tag named while thinking, then the call.
    '<think>I will use <tool_call> to add.</think>\n<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>',
    # The opening tag written twice.
    '<tool_call>\n<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>',
])
def test_json_call_after_an_earlier_opening_tag_is_read(text):
  """The block opened at the first <tool_call>, so its body ('to add.</think>...{...}') was no
  JSON: a well-formed call was malformed ('Expecting value at line 1 column 1')."""
  r = JSON.parse(text)
  assert r.kind == "tool_call" and r.call.name == "calc" and r.call.arguments == {"x": 1}, r
  assert r.raw == r.call.raw == text[text.rindex("<tool_call>"):]
  # A body that is JSON keeps the tag inside its string; one that is no JSON either way stays
  # malformed with the error of the whole body.
  call = '{"name": "w", "arguments": {"t": "a <tool_call> b"}}'
  assert JSON.parse(f"<tool_call>{call}</tool_call>").call.arguments == {"t": "a <tool_call> b"}
  r = JSON.parse('<tool_call>x <tool_call>{"name": }</tool_call>')
  assert r.kind == "malformed" and "line 1 column 1" in r.error, r.error


@pytest.mark.parametrize("parser,text,seen", [
    (XML, '<search query="Lusk">Lusk</search>', '"<search query=\\"Lusk\\">" is not one'),
    (XML, "<Calc>1+1</calc>", '"<Calc>" is not one'),
    (JSON, '<tool_call name="f">{}</tool_call>', '"<tool_call name=\\"f\\">" is not one'),
])
def test_an_opening_tag_with_attributes_or_in_other_case_is_named(parser, text, seen):
  """The model was told its call had no opening tag at all, though it wrote one its own way."""
  r = parser.parse(text)
  assert r.kind == "malformed" and "has no matching" in r.error and seen in r.error, r.error
  bare = parser.parse("no opening" + text[text.rindex("</"):])  # no opening tag at all
  assert "has no matching" in bare.error and "is not one" not in bare.error, bare.error
