"""Chat conversations → tokens and an assistant mask, through the model's own chat template.

A conversation is `{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}` (the
OpenAI / Hugging Face format). The template is the Jinja string of the model folder's `chat_template.jinja` or
`tokenizer_config.json` (`chat_template`), the file transformers' `apply_chat_template` reads. It is untrusted
input: it is compiled and rendered only in jinja2's `ImmutableSandboxedEnvironment` (no attribute access to
Python internals, no mutation of the data it is given), with the helpers transformers gives templates
(`raise_exception`, `tojson`, `strftime_now`); a rendering stops once it passes `max_chars`, as does a value
repeated past it with `*`, and a `**` exponent past MAX_EXPONENT stops the template (`BoundedSandbox`).

Which characters are the assistant's (`assistant_spans`):
- a template with `{% generation %}` ... `{% endgeneration %}` blocks marks them itself (as transformers'
  `return_assistant_tokens_mask=True` requires); the rendered text of each block is a span;
- any other template: for each assistant message i, the conversation up to message i is rendered with the
  generation prompt (`add_generation_prompt=True`), then up to and including message i; what the second adds
  to the first is the span (the reply and the template's end-of-turn text). Both renderings must be prefixes of
  the whole conversation's rendering, which holds for templates that render turn by turn; a template that
  rewrites earlier turns (e.g. drops past reasoning) is refused for that conversation (`ChatRefused`).
A token is an assistant token when its characters overlap a span (transformers' rule), so the masks agree with
`apply_chat_template(..., return_assistant_tokens_mask=True)` on templates with generation blocks.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime

from jinja2 import nodes, pass_eval_context
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import KilnError
from kiln.storage.bounded import read_bytes, read_json_object
from kiln.storage.store import ObjectNotFound

MAX_CHARS = 4_000_000  # a rendered conversation past this is refused: a template cannot make unbounded output
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatRefused(ValueError):
    """One conversation that cannot be rendered (bad messages, the template's own raise_exception, too long, not
    incremental): `reason` is the counter it is reported under (kiln data prepare's manifest `removed`)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # where the template came from, for errors: ".../tokenizer_config.json"
    text: str
    variables: dict  # special tokens the template may use: bos_token, eos_token, ...


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(uri: str, endpoint: str | None = None) -> ChatTemplate:
    """The chat template of a model folder (or of the folder holding a tokenizer.json); KilnError naming the
    file and what is missing."""
    from kiln.storage import open_store

    folder = uri.rstrip("/").rsplit("/", 1)[0] if uri.rstrip("/").endswith(".json") else uri
    try:
        store = open_store(folder.rstrip("/") + "/", endpoint=endpoint)
    except KilnError as err:
        raise KilnError(f"data.tokenizer {uri}: {err}") from None
    config: dict = {}
    try:
        config = read_json_object(store, "tokenizer_config.json", what=f"data.tokenizer {uri}")
    except ObjectNotFound:
        pass
    variables = {k: t for k, v in config.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
    try:  # newer transformers versions save the template in its own file, which takes precedence
        text = read_bytes(store, "chat_template.jinja", what=f"data.tokenizer {uri}").decode("utf-8")
        return ChatTemplate(store.url("chat_template.jinja"), text, variables)
    except ObjectNotFound:
        pass
    except UnicodeDecodeError:
        raise KilnError(f"data.tokenizer {uri}: {store.url('chat_template.jinja')} is not UTF-8 text") from None
    text = config.get("chat_template")
    if isinstance(text, list):  # the older form: named templates, of which "default" is the chat one
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(text, str) or not text.strip():
        raise KilnError(f"data.tokenizer {uri}: no chat template (neither {store.url('chat_template.jinja')} nor a "
                        f"chat_template in {store.url('tokenizer_config.json')}); data.format chat renders "
                        "conversations with the model's chat template")
    return ChatTemplate(store.url("tokenizer_config.json"), text, variables)


class GenerationTracker(Extension):
    """The `{% generation %}` tag: renders its body unchanged and, while a tracker is active, records the
    [start, end) characters of the body in the output (the output so far is the blocks already yielded)."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.tracking: ContextVar = ContextVar("kiln_generation", default=None)
        environment.extend(generation_tracking=self.track)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

    @pass_eval_context
    def _record(self, context, caller):
        text = caller()
        tracking = self.tracking.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def track(self, blocks: list[str], spans: list[tuple[int, int]]):
        token = self.tracking.set((blocks, spans))
        try:
            yield
        finally:
            self.tracking.reset(token)


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


MAX_EXPONENT = 4096  # `**` past this in a template is refused: 2 ** 10 ** 9 would run (and grow) for ever


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, plus bounds on the operators that make huge values from small ones: a string
    or list repeated with `*` past `max_chars` refuses the conversation, and a `**` exponent past MAX_EXPONENT
    stops the template (the output itself is bounded in ChatRenderer._render)."""

    intercepted_binops = frozenset(["*", "**"])
    max_chars = MAX_CHARS

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > self.max_chars:
                    raise ChatRefused("too_long", f"repeats a value past {self.max_chars:,} characters")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"the exponent {right} is past {MAX_EXPONENT}")
        return super().call_binop(context, operator, left, right)


class ChatRenderer:
    """A compiled chat template: render(messages) and assistant_spans(messages). KilnError naming the template's
    file when it does not compile or fails for a reason other than the conversation's."""

    def __init__(self, template: ChatTemplate, max_chars: int = MAX_CHARS):
        self.source, self.max_chars, self.variables = template.source, max_chars, template.variables
        self.env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTracker, loopcontrols])
        self.env.max_chars = max_chars
        self.env.filters["tojson"] = _tojson
        self.env.globals.update(raise_exception=_raise_exception,
                                strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self.template = self.env.from_string(template.text)
        except TemplateSyntaxError as err:
            raise KilnError(f"chat template {self.source}: line {err.lineno}: {err.message}") from None
        self.has_generation = bool(GENERATION_TAG.search(template.text))

    def _render(self, messages: list[dict], add_generation_prompt: bool, spans: list | None = None) -> str:
        """The rendered text; `spans` collects the generation blocks' character ranges."""
        blocks: list[str] = []
        size = 0
        try:
            with self.env.generation_tracking(blocks, spans if spans is not None else []):
                for block in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    **self.variables):
                    blocks.append(block)
                    size += len(block)
                    if size > self.max_chars:
                        raise ChatRefused("too_long", f"renders to more than {self.max_chars:,} characters")
        except SecurityError as err:  # the template, not the conversation: every conversation would fail
            raise KilnError(f"chat template {self.source}: refused by the sandbox: {err}") from None
        except TemplateError as err:
            if type(err) is TemplateError:  # raise_exception(...) in the template: it refuses this conversation
                raise ChatRefused("template_refused", str(err)) from None
            raise KilnError(f"chat template {self.source}: {type(err).__name__}: {err}") from None
        except ChatRefused:
            raise
        except Exception as err:  # noqa: BLE001 - a template can raise anything (TypeError, ZeroDivisionError...)
            raise KilnError(f"chat template {self.source}: {type(err).__name__}: {err}") from None
        return "".join(blocks)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the [start, end) character ranges of the assistant's turns)."""
        check_messages(messages)
        if self.has_generation:
            spans: list[tuple[int, int]] = []
            text = self._render(messages, False, spans)
            return text, [(a, b) for a, b in spans if b > a]
        text = self._render(messages, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], True)
            through = self._render(messages[:i + 1], False)
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatRefused("template_not_incremental",
                                  f"the template does not render message {i} as an extension of the ones before; "
                                  "give it {% generation %} blocks")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return text, spans


def check_messages(messages) -> None:
    """A conversation the template can be given: a non-empty list of {role: str, content: str} with at least one
    assistant turn; ChatRefused says what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ChatRefused("missing_field", "no 'messages' list")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ChatRefused("invalid_message", "a message is not {'role': str, 'content': str}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatRefused("no_assistant_turn", "no assistant message: nothing to train on")


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap an assistant span, else 0 (spans and offsets in order)."""
    mask = [0] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask
