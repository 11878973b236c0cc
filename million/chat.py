"""Rows in, documents out: conversations and prompt/completion rows as token ids and a mask of what is trained.

Rows are {"text": ...}, {"messages": [...], "tools": [...]} or TRL's {"prompt": ..., "completion": ...}, told
apart per row by their keys. A conversation is rendered with the model's chat template exactly as transformers'
apply_chat_template renders it (two forms of the OpenAI API, content as text parts and tool-call arguments in a
JSON string, are also taken where that rendering would drop or refuse them), tokenized once, and only some tokens
are trained on (by default each assistant turn's content and its <|im_end|>, or a prompt's completion). A row
that cannot be trained on is skipped with one line naming its file and line, and counted; a file that is not
UTF-8 stops. The documents go to data.WindowLoader (text rows only) or packing.PackedLoader, which packs each row
as a document of its own.

    python -m million.chat chats.jsonl --tokenizer /path/to/Qwen3-8B --seq_len 32768   # trained tokens shown in [[ ]]
    python -m million.chat synthetic --seq_len 4096 --windows 3                        # text: windows of one stream
    python -m pytest tests/test_rows.py -q; pytest tests/e2e/test_conversations.py -q
"""
import copy
import functools
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Iterator

import jinja2
import jinja2.ext
import numpy as np
import pyarrow.parquet as pq
from jinja2.sandbox import ImmutableSandboxedEnvironment

from data import (DEFAULT_PG19_REPO, ByteTokenizer, Document, HFTokenizer, Skipped, WindowLoader, files_of, iter_books,
                  known_text, load_tokenizer, parse_synthetic, read_rows, tokenized, tokenizer_spec)
from million.packing import PACKINGS, PackedBatches, PackedLoader

ROLES = ("system", "user", "assistant", "tool")
ROW_FIELDS = ("messages", "tools", "prompt", "completion", "chat_template_kwargs")  # read besides the text column
TEMPLATE_FILE = "chat_template.jinja"


class RowError(ValueError):
    """A row that cannot be trained on: it is skipped with one line and counted, and the data goes on."""


def row_format(row: dict, text_column: str = "text") -> str:
    """'messages', 'prompt_completion' or 'text', from the row's keys (a key holding null counts as absent)."""
    has = {k for k, v in row.items() if v is not None}
    if "messages" in has:
        return "messages"
    if {"prompt", "completion"} <= has:
        return "prompt_completion"
    if text_column in has:
        return "text"
    nulls = sorted(set(row) - has)
    raise RowError(f"no field {text_column!r}, 'messages', or 'prompt' and 'completion'; its fields are "
                   f"{sorted(has)}" + (f" and null {nulls}" if nulls else ""))


def model_folder(tokenizer) -> Path | None:
    """The folder of a tokenizer's tokenizer.json (a model folder), where its chat template lives; None for the byte
    tokenizer, which has no files."""
    return tokenizer.path.parent if isinstance(tokenizer, HFTokenizer) else None


def encode_offsets(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """ids [n] int64 and character spans [n, 2] of one encoding of `text` (no special tokens added): what
    apply_chat_template(tokenize=True) makes of a rendered conversation. The byte tokenizer's character starts at
    each byte that is not a UTF-8 continuation byte (0b10xxxxxx)."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        char = np.cumsum((ids & 0xC0) != 0x80) - 1
        return ids, np.stack([char, char + 1], 1)
    enc = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)


def load_chat_template(folder) -> str:
    """The chat template of a model folder, from where transformers 5 takes it: chat_template.jinja if there is
    one, else the "chat_template" of tokenizer_config.json (a string, or a list of {name, template} of which
    the one named "default" is used)."""
    folder = Path(folder)
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        named = {str(t.get("name")): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{config} has chat templates {sorted(named)} and none named 'default'")
        template = named["default"]
    if not isinstance(template, str) or not template:
        raise FileNotFoundError(f"no chat template in {folder}: looked for {TEMPLATE_FILE} and the "
                                "\"chat_template\" field of tokenizer_config.json")
    return template


def template_variables(folder) -> dict:
    """bos_token, eos_token, ...: the named special tokens of the folder's tokenizer_config.json, which
    apply_chat_template hands to every template (Llama's reads bos_token; Qwen3's none)."""
    config = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    values = {k: v.get("content") if isinstance(v, dict) else v for k, v in cfg.items() if k in names}
    return {k: v for k, v in values.items() if isinstance(v, str)}


# Rendering as transformers' apply_chat_template does it (transformers/utils/chat_template_utils.py, read in
# 5.x): a sandboxed jinja environment with trim_blocks, lstrip_blocks and loop controls, a tojson that writes
# plain JSON, raise_exception and strftime_now. {% generation %} ... {% endgeneration %} marks assistant text;
# here its body is rendered between two private-use characters that _render takes out again, keeping where
# they were: the spans are a by-product of the one rendering, with no state kept between renders.
_OPEN, _CLOSE = "\uf8f0", "\uf8f1"


class _GenerationTag(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        return _OPEN + caller() + _CLOSE


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON (tool schemas, arguments)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def _as_template_sees_it(message: dict) -> dict:
    """A message as apply_chat_template passes it: keys holding null left out (a null content or tool_calls,
    from an API or a parquet struct, is absent), and reasoning under an older name ("thinking", "reasoning")
    also given as reasoning_content, which Qwen3's template reads, and as thinking. Content given as a list of
    text parts (the OpenAI API's form) is their texts joined: what Qwen3.5's template renders of them, where
    Qwen3's would render nothing."""
    m = {k: v for k, v in message.items() if v is not None}
    if isinstance(m.get("content"), list):
        m["content"] = "".join(part["text"] for part in m["content"])
    reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def _render(template: str, messages: list, tools=None, add_generation_prompt=False, **extra):
    """(text, spans): the rendering, and the [start, end) character spans of its {% generation %} blocks."""
    raw = _compile(template).render(messages=[_as_template_sees_it(m) for m in messages], tools=tools,
                                    documents=None, add_generation_prompt=add_generation_prompt, **extra)
    if _OPEN not in raw and _CLOSE not in raw:
        return raw, []
    text, spans, opened, length = [], [], [], 0
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", raw):
        if piece == _OPEN:
            opened.append(length)
        elif piece == _CLOSE:
            if not opened:
                raise RowError("the row holds U+F8F1, which marks the end of assistant text here")
            spans.append((opened.pop(), length))
        else:
            text.append(piece)
            length += len(piece)
    if opened:
        raise RowError("the row holds U+F8F0, which marks the start of assistant text here")
    return "".join(text), sorted(spans)


def _parsed_arguments(messages: list) -> list | None:
    """The messages with each tool call's arguments that are a JSON object in a string (the OpenAI API's form)
    parsed into that object; None when there is none."""
    out, changed = copy.deepcopy(messages), False
    for m in out:
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            fn = call.get("function", call) if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            try:
                parsed = json.loads(args) if isinstance(args, str) else None
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                fn["arguments"], changed = parsed, True
    return out if changed else None


def _render_row(template: str, messages: list, tools, variables: dict):
    """_render for a row; a template that fails is a RowError. One that fails on tool-call arguments given as a
    JSON string gets them parsed and runs once more: Qwen3.5's iterates the arguments as a mapping (and so
    does transformers' rendering, which fails there), where Qwen3's prints a string as it is."""
    err = None
    for attempt in (messages, _parsed_arguments(messages)):
        if attempt is None:
            break
        try:
            return _render(template, attempt, tools, False, **variables)
        except RowError:
            raise
        except Exception as e:  # the template is code from the model's folder, run on this row's data
            err = e
    raise RowError(f"the chat template failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}")


def render_chat(template: str, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = False, **extra) -> str:
    """The text of tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, ...) for this template;
    `extra` are the template's other variables (enable_thinking=False; the tokenizer's bos_token, eos_token,
    ... which apply_chat_template adds itself: see template_variables). Compiled once per template."""
    return _render(template, messages, tools, add_generation_prompt, **extra)[0]


def _assistant_spans(template: str, text: str, generated: list) -> list[tuple[int, int]]:
    """The [start, end) character spans of the assistant turns in a full rendering: the template's
    {% generation %} blocks if it has them; else, for ChatML (Qwen's <|im_start|>assistant\\n ... <|im_end|>),
    from the end of each assistant header through its <|im_end|>: the turn's content with any <think> block
    the rendering kept, its tool calls and the <|im_end|> the model must learn to stop on. The header, the
    newline after <|im_end|> and every other role are context."""
    if re.search(r"\{%-?\s*generation\s*-?%\}", template):
        return generated
    if "<|im_start|>" not in template:
        raise ValueError("the chat template marks no assistant text (no {% generation %} tags, no ChatML "
                         "<|im_start|>): set assistant_only_loss and completion_only_loss false to train on "
                         "every token")
    header, end, spans = "<|im_start|>assistant\n", "<|im_end|>", []
    at = text.find(header)
    while at >= 0:
        close = text.find(end, at + len(header))
        spans.append((at + len(header), len(text) if close < 0 else close + len(end)))
        at = text.find(header, spans[-1][1])
    return spans


def _tokens_in(offsets: np.ndarray, spans) -> np.ndarray:
    """[n] bool: the tokens whose characters overlap a span, apply_chat_template's rule for its assistant mask
    (a token that straddles a span's edge is in). offsets [n, 2] rise along the text."""
    mask = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        mask[np.searchsorted(offsets[:, 1], a, side="right"):np.searchsorted(offsets[:, 0], b, side="left")] = True
    return mask


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise RowError("messages must be a non-empty list of messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowError(f"messages[{k}] is a {type(m).__name__}, not an object")
        role, content = m.get("role"), m.get("content")
        if role is None:
            raise RowError(f"messages[{k}] has no field 'role'")
        if role not in ROLES:
            raise RowError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise RowError(f"messages[{k}] ({role}) has no field 'content'")
        if isinstance(content, list):  # parts, as the OpenAI API sends them: text parts only
            for part in content:
                if not (isinstance(part, dict) and part.get("type", "text") == "text"
                        and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RowError(f"messages[{k}] ({role}): a content part of type {kind!r}; only text parts "
                                   "({\"type\": \"text\", \"text\": ...}) are supported")
        elif content is not None and not isinstance(content, str):
            raise RowError(f"messages[{k}] ({role}): content is a {type(content).__name__}; only text (a string "
                           "or a list of text parts) is supported")


def row_document(row: dict, tokenizer, *, chat_template: str | None = None, template_kwargs: dict | None = None,
                 assistant_only_loss: bool = True, completion_only_loss: bool = True,
                 text_column: str = "text") -> tuple[np.ndarray, np.ndarray]:
    """One row -> (ids [n] int64, trained [n] bool); a RowError for a row that cannot be trained on.

    text: the text's tokens and end-of-text, all trained. prompt/completion strings (TRL's convention): the
    concatenation, one encoding, and end-of-text; with completion_only_loss only the completion's tokens and
    the end-of-text are trained. messages, or prompt/completion message lists (the completion's messages
    appended to the prompt's): the whole conversation rendered once with `chat_template` (template_kwargs and
    the row's "chat_template_kwargs" as its variables, the row's "tools") and encoded once, as
    apply_chat_template(tokenize=True) does; assistant_only_loss trains the assistant turns (_assistant_spans),
    completion_only_loss on prompt/completion rows only those of the completion; with neither, every token.
    The mask comes from this one full rendering: Qwen3's template drops the reasoning of assistant turns before
    the last user message, so a turn rendered alone or as a prefix would not be the turn that is trained.
    """
    kind = row_format(row, text_column)
    eos = np.asarray([tokenizer.eos_id], dtype=np.int64)
    if kind == "text":
        if not isinstance(row[text_column], str):
            raise RowError(f"field {text_column!r} is a {type(row[text_column]).__name__}, not text")
        ids = np.concatenate([np.asarray(tokenizer.encode(row[text_column]), dtype=np.int64), eos])
        return ids, np.ones(len(ids), dtype=bool)
    prompt, completion = row.get("prompt"), row.get("completion")
    if kind == "prompt_completion" and isinstance(prompt, str) and isinstance(completion, str):
        ids, offsets = encode_offsets(tokenizer, prompt + completion)
        trained = _tokens_in(offsets, [(len(prompt), len(prompt) + len(completion))]) if completion_only_loss \
            else np.ones(len(ids), dtype=bool)
        ids, trained = np.concatenate([ids, eos]), np.append(trained, True)
    else:
        if kind == "prompt_completion" and not (isinstance(prompt, list) and isinstance(completion, list)):
            raise RowError("prompt and completion must both be strings or both be lists of messages")
        messages, first = (prompt + completion, len(prompt)) if kind == "prompt_completion" else (row["messages"], 0)
        _check_messages(messages)
        tools = row.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RowError("field 'tools' must be a list of JSON schemas (objects)")
        if chat_template is None:
            raise ValueError("a conversation row needs a chat template (chat_template=load_chat_template(folder))")
        variables = {**(template_kwargs or {}), **(row.get("chat_template_kwargs") or {})}
        text, generated = _render_row(chat_template, messages, tools, variables)
        ids, offsets = encode_offsets(tokenizer, text)
        only_completion = kind == "prompt_completion" and completion_only_loss
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if assistant_only_loss or only_completion:
            spans = _assistant_spans(chat_template, text, generated)
            # ChatML turns are found in the text, so a user who writes "<|im_start|>assistant\n" would add one;
            # {% generation %} blocks may be several per turn, which matters only when turns are picked
            if len(spans) != len(turns) and (only_completion or not generated):
                raise RowError(f"the chat template rendered {len(spans)} assistant turns for {len(turns)} "
                               "assistant messages")
            if only_completion:
                spans = [s for s, k in zip(spans, turns) if k >= first]
            trained = _tokens_in(offsets, spans)
        else:
            trained = np.ones(len(ids), dtype=bool)
        if not any(k >= first for k in turns) and not trained[1:].any():
            raise RowError("no token to train on: no assistant message" + (" in the completion" if first else ""))
    if not trained[1:].any():  # the first token is never a target
        raise RowError("no token to train on")
    return ids, trained


def iter_documents(source: str, tokenizer, *, start_row: int = 0, chat_template: str | None = None,
                   template_kwargs: dict | None = None, assistant_only_loss: bool = True,
                   completion_only_loss: bool = True, seed: int = 0, repo: str = DEFAULT_PG19_REPO,
                   revision: str = "main", split: str = "train",
                   text_column: str = "text") -> Iterator[tuple[int, "Document | Skipped"]]:
    """(row_index, Document or Skipped) in a fixed order from row `start_row` on: what the loaders read.

    source: as for iter_books ("synthetic[:N]", "pg19" for parquet on the hub from `repo`, a local .txt,
    .jsonl or .parquet file or a folder of them); each row is read as text, messages or prompt/completion by
    its keys (row_format) and made into a document by row_document with the options given here. A bad row
    (malformed JSON, a missing field, an unknown role, a chat template that raises, nothing to train on) is
    Skipped, with its file and line; a file that is not UTF-8, or a conversation row when there is no chat
    template, stops with a ValueError. chat_template None: the tokenizer folder's (load_chat_template), read
    at the first conversation; its named special tokens join template_kwargs, as in apply_chat_template.
    """
    if start_row < 0:
        raise ValueError(f"start_row must be >= 0, got {start_row}")
    options = dict(assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss,
                   text_column=text_column)
    if parse_synthetic(source) is not None:
        return tokenized(iter_books(source, seed=seed, start_book=start_row, split=split), tokenizer)
    fs, files = files_of(source, split, repo, revision)
    rows = read_rows(fs, files, start_row=start_row, columns=(text_column, *ROW_FIELDS))
    return _row_documents(rows, tokenizer, chat_template, template_kwargs, options)


def _row_documents(rows, tokenizer, template, template_kwargs, options):
    """(index, Document or Skipped) of each (index, where, row) of read_rows: a row that cannot be trained on is
    Skipped. The chat template and its variables are made ready at the first conversation."""
    variables, folder = None, model_folder(tokenizer)  # the template's variables, made at the first conversation
    for index, where, row in rows:
        if isinstance(row, Skipped):
            yield index, row
            continue
        try:
            kind = row_format(row, options["text_column"])
            chat = kind == "messages" or (kind == "prompt_completion" and not isinstance(row["prompt"], str))
            if variables is None and chat:
                if template is None and folder is None:
                    raise ValueError(f"{where} is a conversation, and the byte tokenizer has no chat template; "
                                     "pass --chat_template FILE.jinja")
                try:
                    template = template if template is not None else load_chat_template(folder)
                except FileNotFoundError as err:
                    raise ValueError(f"{where} is a conversation, but there is {err}") from None
                folder_vars = template_variables(folder) if folder is not None else {}
                variables = {**folder_vars, **(template_kwargs or {})}
            yield index, Document(*row_document(row, tokenizer, chat_template=template, template_kwargs=variables,
                                                **options), where)
        except RowError as err:
            yield index, Skipped(where, str(err))


def default_packing(source: str, *, split: str = "train", text_column: str = "text", repo: str = DEFAULT_PG19_REPO,
                    revision: str = "main") -> str:
    """'concat' for text, 'docs' for messages and prompt/completion rows: judged by the first file's parquet
    columns (its footer alone) or first JSON object; the synthetic corpus, PG-19 and .txt files are text."""
    if known_text(source, repo):
        return "concat"
    fs, files = files_of(source, split, repo, revision)
    if files[0].endswith(".parquet"):
        with fs.open(files[0], "rb") as f:
            row = dict.fromkeys(pq.ParquetFile(f).schema_arrow.names, "")
    else:
        rows = (r for _, _, r in read_rows(fs, files[:1], columns=(text_column,)) if not isinstance(r, Skipped))
        row = next(rows, {})
    try:
        return "concat" if row_format(row, text_column) == "text" else "docs"
    except RowError:
        return "concat"


def make_batches(cfg, setup, source: str, kw: dict, grad_accum: int) -> PackedBatches | None:
    """train.py's micro-batches when rows are documents (--packing docs, or auto on rows that are not all text):
    each row a document (text, a conversation, a prompt and its completion), packed into windows (packing.py) whose
    chunks go to ranks by their documents' masked area (documents.py; zigzag with --doc_attention simple).
    None when --packing auto finds text rows: they are laid end to end, as books are (train.make_batches)."""
    from million import documents
    from million.survival import from_rank0, on_rank0
    packing = cfg.packing if cfg.packing != "auto" else from_rank0(on_rank0(lambda: default_packing(
        source, **{k: v for k, v in kw.items() if k != "seed"}), setup.device))
    if packing == "concat":
        return None
    dp, dp_rank = setup.mesh.size(0), setup.mesh.get_local_rank("dp")

    def make_loader():
        tok = load_tokenizer(tokenizer_spec(cfg.tokenizer, setup.model_path))
        if tok.vocab_size > setup.mcfg.vocab_size:
            raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                             f"{setup.mcfg.vocab_size}; use the model's own tokenizer")
        template = open(cfg.chat_template, encoding="utf-8").read() if cfg.chat_template else None
        docs = lambda start: iter_documents(  # noqa: E731
            source, tok, start_row=start, chat_template=template, assistant_only_loss=cfg.assistant_only_loss,
            completion_only_loss=cfg.completion_only_loss, **kw)
        return PackedLoader(docs, cfg.seq_len, tok.eos_id, dp_rank=dp_rank, dp_size=dp)
    cp_group = setup.mesh.get_group("cp")
    layout_of = functools.partial(documents.cp_layout, cp_group.size(), balanced=cfg.doc_attention == "balanced")
    return PackedBatches(make_loader, cfg.seq_len, grad_accum, cp_group, setup.device, layout_of=layout_of)


# ---------------------------------------------------------------------------------------------
# A look at what the loader makes of a source
# ---------------------------------------------------------------------------------------------

def marked(tokenizer, ids: np.ndarray, trained: np.ndarray, context: int | None = None) -> str:
    """The document's text with each run of trained tokens (targets) in [[ ]]. With `context`, a run of untrained
    text (a system prompt, a tool's output) keeps only its first and last `context` lines and says how many it
    leaves out."""
    def shown(text):
        lines = text.split("\n")
        if context is None or len(lines) <= 2 * context + 1:
            return text
        return "\n".join([*lines[:context], f"[... {len(lines) - 2 * context} lines left out ...]", *lines[-context:]])
    cuts = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    runs = zip(np.split(ids, cuts), np.split(trained, cuts))
    return "".join(f"[[{tokenizer.decode(r)}]]" if t[0] else shown(tokenizer.decode(r)) for r, t in runs if len(r))


def main(argv=None) -> None:
    """The first document with its trained tokens marked, then the windows the loader makes of it all."""
    import argparse
    parser = argparse.ArgumentParser(description="print what the loader makes of a source")
    parser.add_argument("source", nargs="?", default="synthetic")  # synthetic | pg19 | a local path
    parser.add_argument("--tokenizer", default="byte")  # byte | a tokenizer.json | a model folder
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--packing", choices=PACKINGS, default=None)  # default: by the data's first row
    parser.add_argument("--chat_template", default=None)  # a .jinja file; default: the tokenizer folder's
    parser.add_argument("--assistant_only_loss", choices=("true", "false"), default="true")
    parser.add_argument("--completion_only_loss", choices=("true", "false"), default="true")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--excerpt", type=int, default=1500, help="characters of the first document to show")
    parser.add_argument("--context", type=int, default=3, help="lines kept at each end of an untrained run")
    args, t0 = parser.parse_args(argv), time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    kind = args.packing or default_packing(args.source, text_column=args.text_column)
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    docs = functools.partial(iter_documents, args.source, tok, chat_template=template, text_column=args.text_column,
                             assistant_only_loss=args.assistant_only_loss == "true",
                             completion_only_loss=args.completion_only_loss == "true")
    first = next((d for _, d in docs(start_row=0) if isinstance(d, Document)), None)
    if first is not None and first.trained.all():
        print(f"{first.where}, {len(first.ids)} tokens, every one trained\n")
    elif first is not None:
        text = marked(tok, first.ids, first.trained, args.context)
        shown, rest = text[:args.excerpt], text[args.excerpt:]
        print(f"{first.where}, {len(first.ids)} tokens, {int(first.trained[1:].sum())} trained ([[ ]]):\n{shown}"
              + (f" ... {len(rest):,} more characters not shown, [[ ]] in them: {rest.count('[[')}" if rest else "")
              + "\n")
    rows = lambda row: docs(start_row=row)  # noqa: E731
    loader = WindowLoader(rows, args.seq_len) if kind == "concat" else PackedLoader(rows, args.seq_len, tok.eos_id)
    for k, w in zip(range(args.windows), loader):
        what = f"{w.numel()} tokens, {int((w == tok.eos_id).sum())} document ends" if kind == "concat" \
            else w.summary()
        print(f"window {k}: {what}, {time.perf_counter() - t0:.2f} s, state {loader.state_dict()}")
    print(f"{loader.skipped} rows skipped so far")
    loader.close()


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, RowError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {type(e).__name__}: {str(e).splitlines()[0]}")
