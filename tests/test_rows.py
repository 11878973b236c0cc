"""chat.py's rows, chat templates and training masks, and packing.py's windows, against transformers and oracles
written here.

transformers is the reference for rendering and tokenizing (apply_chat_template on a tokenizer folder built in
the test); Qwen3's real chat template is the fixture (Qwen/Qwen3-8B tokenizer_config.json "chat_template").

    python -m pytest tests/test_rows.py -q
"""
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from million import chat  # noqa: E402
import data  # noqa: E402
from million import packing  # noqa: E402

transformers = pytest.importorskip("transformers")

QWEN3 = (Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # not special

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# name -> (messages, tools, template variables)
CHATS = {
    "plain": ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"},
               {"role": "assistant", "content": "Hi. How are you?"}], None, {}),
    "no_system": ([{"role": "user", "content": "Où est le café? 東京"},
                   {"role": "assistant", "content": "À droite, près de 東京."}], None, {}),
    # Reasoning of assistant turns before the last user message is dropped; the last one keeps it.
    "reasoning": ([{"role": "user", "content": "Is it sunny?"},
                   {"role": "assistant", "content": "Yes, sunny.", "reasoning_content": "Check the sky first."},
                   {"role": "user", "content": "And tomorrow?"},
                   {"role": "assistant", "content": "Rain.", "reasoning_content": "Clouds are coming."}], None, {}),
    "inline_think": ([{"role": "user", "content": "Two plus two?"},
                      {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nFour."},
                      {"role": "user", "content": "Times three?"},
                      {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\nTwelve."}], None, {}),
    "reasoning_alias": ([{"role": "user", "content": "Why?"},
                         {"role": "assistant", "content": "Because.", "reasoning": "It just is."}], None, {}),
    "tools": ([{"role": "system", "content": "Use tools."},
               {"role": "user", "content": "Weather in Paris and Rome?"},
               {"role": "assistant", "content": "", "reasoning_content": "Two cities, two calls.", "tool_calls": [
                   {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                   {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "content": "sunny, 21 C"},
               {"role": "tool", "content": "rain, 15 C"},
               {"role": "assistant", "content": "Paris is sunny; Rome has rain.",
                "reasoning_content": "Both answered."}], [WEATHER_TOOL], {}),
    "tool_call_without_content": ([{"role": "user", "content": "Weather in Oslo?"},
                                   {"role": "assistant", "content": None, "tool_calls": [
                                       {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                                   {"role": "tool", "content": "snow"},
                                   {"role": "assistant", "content": "Snow in Oslo."}], [WEATHER_TOOL], {}),
    "thinking_off": ([{"role": "user", "content": "Quick answer: 3 + 4?"},
                      {"role": "assistant", "content": "7"}], None, {"enable_thinking": False}),
}


def write_model(folder: Path, config: dict) -> Path:
    """A tokenizer folder like a Qwen3 checkpoint's: a small byte-level BPE trained here, with Qwen3's special and
    added tokens, and tokenizer_config.json (what transformers.AutoTokenizer reads)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m.get("content") or "" for msgs, _, _ in CHATS.values() for m in msgs] + ["assistant user system"]
    tok.train_from_iterator(corpus * 3, trainers.BpeTrainer(vocab_size=450,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(TAGS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         **config}))
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("qwen3ish"), {"chat_template": QWEN3})


@pytest.fixture(scope="module")
def hf(model):
    return transformers.AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def tok(model):
    return data.load_tokenizer(str(model))


def tagged(template: str) -> str:
    """Qwen3's template with transformers' {% generation %} tags around what an assistant turn generates: the
    content (with the <think> block where kept), the tool calls and <|im_end|>; not the header, not the newline."""
    edits = [
        ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' "
         "+ content.lstrip('\\n') }}",
         "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- '<think>\\n' + reasoning_content.strip('\\n')"
         " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}{% endgeneration %}"),
        ("{{- '<|im_start|>' + message.role + '\\n' + content }}",
         "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- content }}{% endgeneration %}"),
        ("{%- if message.tool_calls %}", "{% generation %}{%- if message.tool_calls %}"),
        ("        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
         "        {%- endif %}{% endgeneration %}\n        {% generation %}{{- '<|im_end|>' }}{% endgeneration %}"
         "{{- '\\n' }}\n    {%- elif message.role == \"tool\" %}"),
    ]
    for old, new in edits:
        assert old in template, old
        template = template.replace(old, new)
    return template


def as_reasoning_content(messages):
    """The messages with reasoning under an older name ("thinking", "reasoning") renamed reasoning_content, the
    name Qwen3's template reads. chat.py reads the older names in every version; transformers does from some 5.x
    on (5.24 does, 5.17 does not), so the reference renders the renamed messages: the same text in every version."""
    renamed = []
    for m in messages:
        alias = next((k for k in ("thinking", "reasoning") if k in m), None)
        if alias is not None and "reasoning_content" not in m:
            m = {**{k: v for k, v in m.items() if k != alias}, "reasoning_content": m[alias]}
        renamed.append(m)
    return renamed


def row_of(messages, tools):
    return {"messages": messages, **({"tools": tools} if tools else {})}


# ---------------------------------------------------------------------------------------------
# Rendering and tokens: the same as apply_chat_template
# ---------------------------------------------------------------------------------------------

def test_the_fixture_is_qwen3s_template():
    assert len(QWEN3) == 4168 and "enable_thinking is defined and enable_thinking is false" in QWEN3
    assert "{%- if message.reasoning_content is string %}" in QWEN3 and "ns.last_query_index" in QWEN3


@pytest.mark.parametrize("name", CHATS)
def test_rendering_and_ids_match_apply_chat_template(name, hf, tok):
    messages, tools, kw = CHATS[name]
    reference = as_reasoning_content(messages)
    for gen in (False, True):
        want = hf.apply_chat_template(reference, tools=tools, tokenize=False, add_generation_prompt=gen, **kw)
        assert chat.render_chat(QWEN3, messages, tools, add_generation_prompt=gen, **kw) == want
    ids, trained = chat.row_document(row_of(messages, tools), tok, chat_template=QWEN3, template_kwargs=kw)
    want_ids = hf.apply_chat_template(reference, tools=tools, tokenize=True, **kw)["input_ids"]
    assert ids.dtype == np.int64 and ids.tolist() == want_ids
    assert trained.dtype == bool and trained.shape == ids.shape


def test_enable_thinking_false_closes_an_empty_think_block(hf):
    messages = CHATS["thinking_off"][0][:1]
    text = chat.render_chat(QWEN3, messages, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert chat.render_chat(QWEN3, messages, add_generation_prompt=True).endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------
# Which tokens are trained on
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CHATS)
def test_assistant_mask_matches_transformers_generation_mask(name, hf, tok):
    """Our ChatML rule on Qwen3's own template, and our {% generation %} support on the tagged one, both equal the
    assistant_masks transformers makes from the tagged template."""
    messages, tools, kw = CHATS[name]
    template = tagged(QWEN3)
    assert chat.render_chat(template, messages, tools, **kw) == chat.render_chat(QWEN3, messages, tools, **kw)
    out = hf.apply_chat_template(as_reasoning_content(messages), tools=tools, chat_template=template, tokenize=True,
                                 return_dict=True, return_assistant_tokens_mask=True, **kw)
    want = np.asarray(out["assistant_masks"], dtype=bool)
    for t in (QWEN3, template):
        ids, trained = chat.row_document(row_of(messages, tools), tok, chat_template=t, template_kwargs=kw)
        assert ids.tolist() == out["input_ids"]
        np.testing.assert_array_equal(trained, want)


def test_the_mask_comes_from_the_full_rendering(tok):
    """Earlier reasoning is dropped from the rendering, so it is not trained; the last turn's is. Each trained run
    is a turn's content and its <|im_end|>; headers, the newline after <|im_end|> and other roles are not."""
    ids, trained = chat.row_document(row_of(*CHATS["reasoning"][:2]), tok, chat_template=QWEN3)
    assert chat.marked(tok, ids, trained) == (
        "<|im_start|>user\nIs it sunny?<|im_end|>\n<|im_start|>assistant\n[[Yes, sunny.<|im_end|>]]\n"
        "<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
        "<|im_start|>assistant\n[[<think>\nClouds are coming.\n</think>\n\nRain.<|im_end|>]]\n")
    ids, trained = chat.row_document(row_of(*CHATS["tools"][:2]), tok, chat_template=QWEN3)
    runs = chat.marked(tok, ids, trained).split("[[")[1:]
    assert [r.split("]]")[0] for r in runs] == [
        '<think>\nTwo cities, two calls.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        "</tool_call><|im_end|>",
        "<think>\nBoth answered.\n</think>\n\nParis is sunny; Rome has rain.<|im_end|>"]
    ids, trained = chat.row_document(row_of(*CHATS["tools"][:2]), tok, chat_template=QWEN3,
                                     assistant_only_loss=False)
    assert trained.all()


def by_hand_mask(text: str, turns: list[str], offsets) -> np.ndarray:
    """The oracle of assistant_only_loss written out: find each assistant turn's rendered text in order, and mark
    the tokens that overlap it."""
    mask, at = np.zeros(len(offsets), dtype=bool), 0
    for turn in turns:
        at = text.index(turn, at)
        for k, (s, e) in enumerate(offsets):
            mask[k] |= s < at + len(turn) and e > at
        at += len(turn)
    return mask


def test_assistant_mask_by_hand(tok):
    messages = CHATS["inline_think"][0]
    ids, trained = chat.row_document({"messages": messages}, tok, chat_template=QWEN3)
    text = chat.render_chat(QWEN3, messages)
    turns = ["Four.<|im_end|>", "<think>\nmultiply\n</think>\n\nTwelve.<|im_end|>"]  # the first loses its reasoning
    np.testing.assert_array_equal(trained, by_hand_mask(text, turns, chat.encode_offsets(tok, text)[1]))


def test_prompt_completion_strings(hf, tok):
    row = {"prompt": "The weather in Paris is", "completion": " sunny and warm."}
    eos = tok.tokenizer.token_to_id("<|endoftext|>")
    assert tok.eos_id == eos
    ids, trained = chat.row_document(row, tok)
    assert ids.tolist() == hf(row["prompt"] + row["completion"])["input_ids"] + [eos]
    n_prompt = len(hf(row["prompt"])["input_ids"])  # TRL's boundary; here no token straddles it
    np.testing.assert_array_equal(trained, np.arange(len(ids)) >= n_prompt)
    assert chat.marked(tok, ids, trained) == "The weather in Paris is[[ sunny and warm.<|endoftext|>]]"
    assert chat.row_document(row, tok, completion_only_loss=False)[1].all()


def test_prompt_completion_messages(hf, tok):
    prompt = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Is it sunny?"},
              {"role": "assistant", "content": "Yes, sunny."}, {"role": "user", "content": "And tomorrow?"}]
    completion = [{"role": "assistant", "content": "Rain.", "reasoning_content": "Clouds are coming."}]
    row = {"prompt": prompt, "completion": completion}
    ids, trained = chat.row_document(row, tok, chat_template=QWEN3)
    assert ids.tolist() == hf.apply_chat_template(prompt + completion, tokenize=True)["input_ids"]
    assert chat.marked(tok, ids, trained).endswith(
        "<|im_start|>assistant\n[[<think>\nClouds are coming.\n</think>\n\nRain.<|im_end|>]]\n")
    assert chat.marked(tok, ids, trained).count("[[") == 1  # the prompt's assistant turn is context
    # TRL's completion mask starts after the prompt rendered with its generation prompt: ours lies inside it.
    n_prompt = len(hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert ids[:n_prompt].tolist() == hf.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
    assert not trained[:n_prompt].any() and trained[n_prompt:-1].all() and not trained[-1]  # the last is "\n"
    # completion_only_loss false: a conversation like a messages row (every assistant turn)
    _, every = chat.row_document(row, tok, chat_template=QWEN3, completion_only_loss=False)
    np.testing.assert_array_equal(every, chat.row_document({"messages": prompt + completion}, tok,
                                                           chat_template=QWEN3)[1])
    assert every.sum() > trained.sum()


# A template written here with two habits of Qwen3.5's: content given as a list of parts rendered as their texts
# joined, and tool-call arguments iterated as a mapping (`|items`), on which a JSON string fails, in transformers too
PARTS_AND_ITEMS = """{%- macro text(c) %}{%- if c is string %}{{- c }}{%- else %}{%- for p in c %}{{- p.text }}
{%- endfor %}{%- endif %}{%- endmacro %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ text(m.content) if m.content is defined else '' }}{%- for call in m.tool_calls or [] %}
{%- set f = call.function if call.function is defined else call %}<tool_call>
<function={{ f.name }}>
{%- for k, v in f.arguments|items %}<parameter={{ k }}>{{ v }}</parameter>{%- endfor %}
</function></tool_call>{%- endfor %}<|im_end|>
{% endfor %}"""


def test_arguments_in_a_json_string_reach_a_template_that_iterates_them(hf, tok):
    """Tool-call arguments as the OpenAI API sends them (a JSON string): Qwen3's template prints them as they are
    (test_rendering_and_ids_match_apply_chat_template); one that iterates them (Qwen3.5's) fails on the string,
    as transformers' rendering does, and gets them parsed: transformers' ids for the parsed messages. A string
    that is not a JSON object still skips the row with the template's error."""
    messages, tools, _ = CHATS["tools"]
    parsed = json.loads(json.dumps(messages))
    parsed[2]["tool_calls"][1]["function"]["arguments"] = {"city": "Rome"}
    with pytest.raises(TypeError, match="mapping"):
        hf.apply_chat_template(messages, tools=tools, chat_template=PARTS_AND_ITEMS, tokenize=False)
    ids, trained = chat.row_document(row_of(messages, tools), tok, chat_template=PARTS_AND_ITEMS)
    assert ids.tolist() == hf.apply_chat_template(parsed, tools=tools, chat_template=PARTS_AND_ITEMS)["input_ids"]
    assert "<parameter=city>Rome</parameter>" in chat.marked(tok, ids, trained)
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == '{"city": "Rome"}'  # the row is not changed
    parsed[2]["tool_calls"][1]["function"]["arguments"] = "city=Rome"
    with pytest.raises(chat.RowError, match=r"^the chat template failed: TypeError: Can only get item pairs from a "
                                            r"mapping\.$"):
        chat.row_document(row_of(parsed, tools), tok, chat_template=PARTS_AND_ITEMS)


def test_content_as_text_parts(hf, tok):
    """Content as a list of text parts (the OpenAI API's form) is trained as their texts joined: what a template
    that renders parts makes of them (transformers' ids for the parts themselves), and what Qwen3's template gets
    (transformers' ids for the joined strings; given the list, Qwen3's template renders no content at all). A part
    that is not text skips the row with one line."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"text": "Paris?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]}]
    joined = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."}]
    ids, trained = chat.row_document({"messages": parts}, tok, chat_template=QWEN3)
    assert ids.tolist() == hf.apply_chat_template(joined, tokenize=True)["input_ids"]
    assert chat.marked(tok, ids, trained).endswith("assistant\n[[<think>\n\n</think>\n\nSunny.<|im_end|>]]\n")
    ids, _ = chat.row_document({"messages": parts}, tok, chat_template=PARTS_AND_ITEMS)
    assert ids.tolist() == hf.apply_chat_template(parts, chat_template=PARTS_AND_ITEMS)["input_ids"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}, joined[1]]
    with pytest.raises(chat.RowError, match=r"^messages\[0\] \(user\): a content part of type 'image_url'; only "
                                            r"text parts \(\{\"type\": \"text\", \"text\": \.\.\.\}\) are supported$"):
        chat.row_document({"messages": image}, tok, chat_template=QWEN3)


def test_a_byte_tokenizer_marks_characters_not_bytes():
    ids, offsets = chat.encode_offsets(data.ByteTokenizer(), "aé東")
    assert ids.tolist() == list("aé東".encode()) and offsets[:, 0].tolist() == [0, 1, 1, 2, 2, 2]
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    row = {"messages": [{"role": "user", "content": "né?"}, {"role": "assistant", "content": "oui, né"}]}
    ids, trained = chat.row_document(row, data.ByteTokenizer(), chat_template=template)
    assert chat.marked(data.ByteTokenizer(), ids, trained) == \
        "<|im_start|>user\nné?<|im_end|>\n<|im_start|>assistant\n[[oui, né<|im_end|>]]\n"


# ---------------------------------------------------------------------------------------------
# Templates from a folder; the named special tokens
# ---------------------------------------------------------------------------------------------

def test_load_chat_template_and_template_variables(tmp_path, hf):
    simple = "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    folder = write_model(tmp_path / "listed", {
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},  # older configs
        "chat_template": [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": simple}]})
    assert chat.load_chat_template(folder) == simple
    assert chat.template_variables(folder) == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                                               "pad_token": "<|endoftext|>"}
    rows = tmp_path / "chat.jsonl"
    messages = CHATS["plain"][0]
    rows.write_text(json.dumps({"messages": messages}) + "\n")
    tok = data.load_tokenizer(str(folder))
    [(index, doc)] = list(chat.iter_documents(str(rows), tok))
    assert index == 0
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert doc.ids.tolist() == reference.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert tok.decode(doc.ids[:1]) == "<|endoftext|>"  # the template's bos_token
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")  # the file wins, as in transformers
    assert chat.load_chat_template(folder) == "{{ messages[0].content }}"
    nameless = write_model(tmp_path / "nameless", {"chat_template": [{"name": "rag", "template": "x"}]})
    with pytest.raises(ValueError, match=r"chat templates \['rag'\] and none named 'default'"):
        chat.load_chat_template(nameless)


# ---------------------------------------------------------------------------------------------
# Bad rows: skipped with a line naming file and line, and counted; bad files stop
# ---------------------------------------------------------------------------------------------

def drain(loader):
    out = list(loader)
    loader.close()
    return out


def test_bad_rows_are_skipped_with_one_line_each(tmp_path, tok):
    good = {"messages": CHATS["plain"][0]}
    lines = [
        json.dumps(good),                                                                       # 1
        json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),                       # 2
        json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "?"}]}),    # 3
        "",                                                                                     # 4: blank, no row
        '{"messages": [{"role": "user", "content": "unterminated}',                             # 5
        json.dumps({"messages": [{"role": "user", "content": "hi"},                             # 6: the template
                                 {"role": "assistant", "content": "x", "tool_calls": 5}]}),     #    iterates an int
        json.dumps({"messages": [{"role": "user", "content": "anyone?"}]}),                     # 7
        json.dumps({"title": "no body"}),                                                       # 8
        json.dumps({"prompt": "a string", "completion": [{"role": "assistant", "content": "b"}]}),  # 9
        json.dumps({"prompt": "Say hi:", "completion": " hi"}),                                 # 10
        "[1, 2]",                                                                               # 11
        json.dumps({"messages": [{"role": "user", "content": "<|im_start|>assistant\nI am not"},  # 12
                                 {"role": "assistant", "content": "ok"}]}),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    said = []
    loader = packing.PackedLoader(lambda r: chat.iter_documents(str(path), tok, start_row=r), 16, tok.eos_id,
                                  log=said.append)
    windows = drain(loader)
    assert said == [
        "data: rows.jsonl line 2: unknown role 'robot' (roles: system, user, assistant, tool); row skipped",
        "data: rows.jsonl line 3: messages[0] (user) has no field 'content'; row skipped",
        "data: rows.jsonl line 5: malformed JSON (Unterminated string starting at: column 43); row skipped",
        "data: rows.jsonl line 6: the chat template failed: TypeError: 'int' object is not iterable; row skipped",
        "data: rows.jsonl line 7: no token to train on: no assistant message; row skipped",
        "data: rows.jsonl line 8: no field 'text', 'messages', or 'prompt' and 'completion'; its fields are "
        "['title']; row skipped",
        "data: rows.jsonl line 9: prompt and completion must both be strings or both be lists of messages; "
        "row skipped",
        "data: rows.jsonl line 11: a JSON list, not an object; row skipped",
        "data: rows.jsonl line 12: the chat template rendered 2 assistant turns for 1 assistant messages; "
        "row skipped"]
    assert loader.skipped == 9 and loader.state_dict()["skipped"] == 9
    good_pairs = sum(len(chat.row_document(r, tok, chat_template=QWEN3)[0]) - 1
                     for r in (good, json.loads(lines[9])))
    assert sum(T - w.pad for w in windows for T in [16]) == good_pairs


def test_a_template_that_raises_skips_the_row(tmp_path, tok):
    template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role, sorry') }}"
                "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (CHATS["no_system"][0], CHATS["plain"][0])))
    docs = list(chat.iter_documents(str(path), tok, chat_template=template))
    assert isinstance(docs[0][1], data.Document) and docs[1] == (1, data.Skipped(
        "chats.jsonl line 2", "the chat template failed: TemplateError: no system role, sorry"))


def test_parquet_rows_name_the_row(tmp_path, tok):
    messages = [CHATS["no_system"][0], [{"role": "robot", "content": "x"}], CHATS["reasoning"][0]]
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"messages": messages, "id": [1, 2, 3]}), path, row_group_size=2)
    docs = list(chat.iter_documents(str(path), tok, start_row=1))
    assert docs[0] == (1, data.Skipped("chats.parquet row 2", "unknown role 'robot' (roles: system, user, "
                                                              "assistant, tool)"))
    # Structs come back with every field: a null reasoning_content is left out, as transformers does.
    want = chat.row_document({"messages": messages[2]}, tok, chat_template=QWEN3)
    assert docs[1][0] == 2 and docs[1][1].where == "chats.parquet row 3"
    assert docs[1][1].ids.tolist() == want[0].tolist() and docs[1][1].trained.tolist() == want[1].tolist()
    assert chat.default_packing(str(path)) == "docs"


def test_conversations_stream_from_the_hub(tmp_path, tok, monkeypatch):
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.table({"messages": [CHATS["plain"][0], CHATS["reasoning"][0]]}), path)

    class FakeHub(LocalFileSystem):  # the hub's layout, served from the local file
        def glob(self, pattern, **kw):
            assert pattern == "datasets/someone/chats@main/**/*.parquet"
            return [str(path)]

    monkeypatch.setattr(data, "HfFileSystem", FakeHub)
    docs = list(chat.iter_documents("pg19", tok, repo="someone/chats", start_row=1))
    assert [(i, d.where) for i, d in docs] == [(1, "train-00000-of-00001.parquet row 2")]
    assert docs[0][1].ids.tolist() == chat.row_document({"messages": CHATS["reasoning"][0]}, tok,
                                                        chat_template=QWEN3)[0].tolist()
    assert chat.default_packing("pg19", repo="someone/chats") == "docs" and chat.default_packing("pg19") == "concat"


def test_bad_files_and_a_missing_template_stop_with_one_line(tmp_path, tok):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    for loader in (packing.PackedLoader(lambda r: chat.iter_documents(str(latin1), tok, start_row=r), 4, tok.eos_id),
                   data.WindowLoader(lambda r: data.tokenized(data.iter_books(str(latin1), start_book=r), tok), 4)):
        with pytest.raises(ValueError, match=r"latin1.jsonl is not UTF-8 text \(line 2, byte 13: .*convert it"):
            drain(loader)
    (tmp_path / "book.txt").write_bytes(b"\xff\xfeh\x00i\x00")
    with pytest.raises(ValueError, match=r"book.txt is not UTF-8 text \(byte 0"):
        list(data.iter_books(str(tmp_path / "book.txt")))
    bare = write_model(tmp_path / "bare", {})
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in (  # text and prompt/completion strings need no template
        {"text": "a book first"}, {"prompt": "Say hi:", "completion": " hi"}, {"messages": CHATS["plain"][0]})))
    loader = packing.PackedLoader(lambda r: chat.iter_documents(str(chats), data.load_tokenizer(str(bare)),
                                                                start_row=r), 4, tok.eos_id)
    with pytest.raises(ValueError) as info:
        drain(loader)
    assert str(info.value) == (f"chats.jsonl line 3 is a conversation, but there is no chat template in {bare}: "
                               'looked for chat_template.jinja and the "chat_template" field of tokenizer_config.json')


def test_the_text_path_names_file_and_line(tmp_path, tok):
    books = ["First book.", "Second book.", "Third book."]
    path = tmp_path / "books.jsonl"
    path.write_text(json.dumps({"text": books[0]}) + "\n" + json.dumps({"text": books[1]})[:-3] + "\n"
                    + json.dumps({"text": books[2]}) + "\n")
    assert list(data.iter_books(str(path)))[1] == (1, data.Skipped(
        "books.jsonl line 2", "malformed JSON (Unterminated string starting at: column 10)"))
    said = []
    byte = data.ByteTokenizer()
    loader = data.WindowLoader(lambda b: data.tokenized(data.iter_books(str(path), start_book=b), byte), 5,
                               log=said.append)
    stream = torch.tensor([x for b in (books[0], books[2]) for x in list(b.encode()) + [256]])
    assert torch.equal(torch.cat(drain(loader)), stream[:len(stream) // 6 * 6])
    assert said == ["data: books.jsonl line 2: malformed JSON (Unterminated string starting at: column 10); "
                    "row skipped"] and loader.skipped == 1
    # iter_documents makes the same concat stream from text rows
    same = data.WindowLoader(lambda b: chat.iter_documents(str(path), byte, start_row=b), 5, log=said.append)
    assert torch.equal(torch.cat(drain(same)), stream[:len(stream) // 6 * 6])
    with pytest.raises(ValueError, match=r"books.jsonl line 1 has no field 'body'"):
        list(data.iter_books(str(path), text_column="body"))
    # A conversation cannot be laid into a concat stream, whose every label is kept.
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": CHATS["plain"][0]}) + "\n")
    with pytest.raises(ValueError, match="chats.jsonl line 1: packing 'concat' trains on every token.*packing 'docs'"):
        drain(data.WindowLoader(lambda r: chat.iter_documents(str(chats), tok, start_row=r), 8))
    assert chat.default_packing(str(chats)) == "docs" and chat.default_packing(str(path)) == "concat"


# ---------------------------------------------------------------------------------------------
# Packing documents into windows
# ---------------------------------------------------------------------------------------------

def oracle_windows(docs, T, eos, ranks):
    """Every document's pairs end to end, cut every T pairs; a cut starts a new document; the tail padded (input
    eos, label -100) to whole rounds of `ranks` windows. -> [(inputs, labels, doc_lens, pad, untrained)]."""
    inputs, labels, doc = [], [], []
    for k, (ids, trained) in enumerate(docs):
        for i in range(len(ids) - 1):
            inputs.append(int(ids[i]))
            labels.append(int(ids[i + 1]) if trained[i + 1] else -100)
            doc.append(k)
    count = math.ceil(math.ceil(len(inputs) / T) / ranks) * ranks
    pad = count * T - len(inputs)
    inputs, labels, doc = inputs + [eos] * pad, labels + [-100] * pad, doc + [-1] * pad
    out = []
    for w in range(count):
        cut = slice(w * T, (w + 1) * T)
        lens = [1]
        for a, b in zip(doc[cut], doc[cut][1:]):
            lens[-1:] = [lens[-1] + 1] if a == b else [lens[-1], 1]
        n_pad = doc[cut].count(-1)
        out.append((inputs[cut], labels[cut], lens, n_pad, labels[cut].count(-100) - n_pad))
    return out


@pytest.fixture
def mixed(tmp_path, tok):
    """A file of every row kind: short and long conversations (longer than two windows), prompt/completion in both
    forms, text, and bad rows in between."""
    long_chat = [{"role": "user", "content": "Tell me about the weather, at length."},
                 {"role": "assistant", "content": "The weather is sunny in Paris. " * 12}]
    rows = [{"messages": CHATS["plain"][0]}, {"text": "Hello there, how are you?"}, {"messages": long_chat},
            {"messages": [{"role": "robot", "content": "x"}]},
            {"prompt": "The weather is", "completion": " sunny."}, row_of(*CHATS["tools"][:2]),
            {"prompt": CHATS["reasoning"][0][:3], "completion": CHATS["reasoning"][0][3:]},
            {"messages": CHATS["no_system"][0]}, {"title": "nothing"}, {"text": "The end."}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = [chat.row_document(r, tok, chat_template=QWEN3) for k, r in enumerate(rows) if k not in (3, 8)]
    return path, docs


@pytest.mark.parametrize("T", [37, 128])
def test_packed_windows_match_the_oracle(mixed, tok, T):
    path, docs = mixed
    assert max(len(ids) for ids, _ in docs) > 2 * 37  # one document spans three windows
    for ranks in (1, 2, 3):
        want = oracle_windows(docs, T, tok.eos_id, ranks)
        for rank in range(ranks):
            loader = packing.PackedLoader(lambda r: chat.iter_documents(str(path), tok, start_row=r), T, tok.eos_id,
                                          dp_rank=rank, dp_size=ranks, log=lambda line: None)
            got = drain(loader)
            assert len(got) == len(want) // ranks  # every rank the same number of windows
            for w, (inputs, labels, lens, pad, untrained) in zip(got, want[rank::ranks]):
                assert isinstance(w, packing.Window) and w.inputs.dtype == w.labels.dtype == torch.int64
                assert w.inputs.tolist() == inputs and w.labels.tolist() == labels
                assert w.doc_lens == lens and sum(w.doc_lens) == T
                assert (w.pad, w.untrained) == (pad, untrained)
            assert loader.skipped == 2
    assert want[-1][3] > 0  # the data ends inside a window: padded, not dropped


def test_a_long_document_is_split_and_its_continuation_starts_over(tok):
    ids = np.arange(10, 10 + 23, dtype=np.int64)
    trained = np.ones(23, dtype=bool)
    trained[:5] = False  # a prompt of 5 tokens
    docs = lambda start: iter([(0, data.Document(ids, trained, "doc"))][start:])  # noqa: E731
    windows = drain(packing.PackedLoader(docs, 10, tok.eos_id, dp_size=1))
    assert [w.doc_lens for w in windows] == [[10], [10], [2, 8]]  # 22 pairs: 10, 10, then 2 and padding
    assert torch.cat([w.inputs for w in windows])[:22].tolist() == ids[:-1].tolist()
    assert torch.cat([w.labels for w in windows])[:22].tolist() == [-100] * 4 + ids[5:].tolist()
    assert [(w.pad, w.untrained) for w in windows] == [(0, 4), (0, 0), (8, 0)]
    assert [w.documents for w in windows] == [1, 1, 1]  # the padding is no document
    assert packing.doc_positions(windows[2].doc_lens).tolist() == [0, 1] + list(range(8))
    assert windows[2].inputs[2:].tolist() == [tok.eos_id] * 8 and (windows[2].labels[2:] == -100).all()
    # dp 2: a third window is padding through and through, so both ranks get two
    two = [drain(packing.PackedLoader(docs, 10, tok.eos_id, dp_rank=r, dp_size=2)) for r in (0, 1)]
    assert [len(w) for w in two] == [2, 2] and two[1][1].doc_lens == [10] and two[1][1].pad == 10
    assert (two[1][1].labels == -100).all() and two[1][1].untrained == 0 and two[1][1].documents == 0


def concat_view(w: torch.Tensor) -> packing.Window:
    """A concat window w [T + 1] seen as a packed Window: one document, every label kept."""
    return packing.Window(w[:-1], w[1:], [w.numel() - 1], 0, 0)


def test_doc_positions_and_the_concat_view():
    lens = [3, 1, 5, 2]
    want = [i for n in lens for i in range(n)]
    assert packing.doc_positions(lens).tolist() == want and packing.doc_positions(lens).dtype == torch.int64
    w = torch.arange(8)
    view = concat_view(w)
    assert view.inputs.tolist() == list(range(7)) and view.labels.tolist() == list(range(1, 8))
    assert view.doc_lens == [7] and (view.pad, view.untrained) == (0, 0)
    assert packing.doc_positions(view.doc_lens).tolist() == list(range(7))


@pytest.mark.parametrize("before, ranks", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_packed_resume_gives_the_same_windows(mixed, tok, before, ranks):
    path, _ = mixed
    docs = lambda r: chat.iter_documents(str(path), tok, start_row=r)  # noqa: E731
    for rank in range(ranks):
        first = packing.PackedLoader(docs, 23, tok.eos_id, rank, ranks, prefetch=8, log=lambda line: None)
        whole = drain(packing.PackedLoader(docs, 23, tok.eos_id, rank, ranks, log=lambda line: None))
        for _ in range(before):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))
        skipped = first.skipped
        rest = drain(first)
        fresh = packing.PackedLoader(docs, 23, tok.eos_id, rank, ranks, prefetch=1, log=lambda line: None)
        fresh.load_state_dict(state)
        assert fresh.skipped == skipped
        again = drain(fresh)
        assert len(rest) == len(again) == len(whole) - before > 0
        for a, b, c in zip(rest, again, whole[before:]):
            assert a.inputs.tolist() == b.inputs.tolist() == c.inputs.tolist()
            assert a.labels.tolist() == b.labels.tolist() == c.labels.tolist()
            assert a.doc_lens == b.doc_lens == c.doc_lens and (a.pad, a.untrained) == (b.pad, b.untrained)
        assert fresh.skipped == first.skipped == 2
    if (before, ranks) == (2, 1):
        assert state["offset"] > 0 and state["packing"] == "docs"  # resumes inside a split document
    with pytest.raises(ValueError, match="packed with 'docs'.*same packing"):
        data.WindowLoader(docs, 23).load_state_dict(state)


def test_the_command_line_marks_what_is_trained(mixed, model, capsys):
    path, _ = mixed
    chat.main([str(path), "--tokenizer", str(model), "--seq_len", "64", "--windows", "2"])  # docs, by the rows
    out = capsys.readouterr()
    assert "mixed.jsonl line 1, " in out.out
    assert "<|im_start|>assistant\n[[<think>\n\n</think>\n\nHi. How are you?<|im_end|>]]\n" in out.out
    assert "window 0: " in out.out and "documents, padding 0.0%, not trained" in out.out
    assert "'packing': 'docs'" in out.out
    assert "data: mixed.jsonl line 4: unknown role 'robot'" in out.err


def test_marked_context_shortens_untrained_text_only(tok):
    ids, trained = chat.row_document(row_of(*CHATS["tools"][:2]), tok, chat_template=QWEN3)
    full, short = chat.marked(tok, ids, trained), chat.marked(tok, ids, trained, context=2)
    system = full.split("[[")[0].split("\n")  # the system prompt with its tools, up to the first trained run
    assert len(system) > 5
    assert short.split("[[")[0] == "\n".join(system[:2] + [f"[... {len(system) - 4} lines left out ...]"] + system[-2:])
    assert re.findall(r"\[\[.*?\]\]", short, re.S) == re.findall(r"\[\[.*?\]\]", full, re.S)


def test_the_command_line_says_what_it_leaves_out(mixed, model, tok, capsys):
    """The first document is cut at --excerpt, saying how much is left out; the padding is not counted as a
    document."""
    path, docs = mixed
    chat.main([str(path), "--tokenizer", str(model), "--seq_len", "4096", "--windows", "1", "--excerpt", "40"])
    out = capsys.readouterr().out
    text = chat.marked(tok, *docs[0])
    assert text[40:].count("[[") == 1
    assert f"{text[:40]} ... {len(text) - 40:,} more characters not shown, [[ ]] in them: 1\n" in out
    assert sum(len(ids) - 1 for ids, _ in docs) < 4096  # one window: every document, then padding
    assert f"window 0: {len(docs)} documents, padding " in out
