"""A model's chat template (the Jinja `chat_template` of its tokenizer), rendered as transformers renders it.

The same environment as transformers' apply_chat_template: jinja2's ImmutableSandboxedEnvironment (a
template is untrusted code from a model repository: reaching outside the sandbox raises SecurityError),
trim_blocks and lstrip_blocks, loop controls, `raise_exception`, a `tojson` that does not escape HTML,
`strftime_now`, and the `{% generation %}` tag, whose body's character spans are recorded: they mark the
assistant's tokens in templates that have the tag. The special tokens (bos_token, eos_token, ...) come from
tokenizer_config.json, as transformers passes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hpkit import json_text
from hpkit.errors import HpkitError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateRefused(HpkitError):
    """The template raised (raise_exception: a role or an order it refuses) or failed while rendering."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records the (start, end) characters of its body's output."""

    tags: ClassVar[set[str]] = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.tracking: tuple[list[str], list[tuple[int, int]]] | None = None

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller: Any) -> str:
        text = caller()
        if self.tracking is not None:
            blocks, spans = self.tracking
            start = sum(len(b) for b in blocks)  # what the template has emitted before this block
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@dataclass
class Rendered:
    text: str
    generation: list[tuple[int, int]]  # the {% generation %} spans; empty if the template has none


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str], where: str) -> None:
        if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
            # Older versions have known sandbox escapes, and a chat template is untrusted code.
            raise HpkitError(
                f"jinja2 {jinja2.__version__} has known sandbox escapes: pip install 'jinja2>=3.1.6'"
            )
        self.source, self.special, self.where = source, special, where
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._tracker = next(e for e in env.extensions.values() if isinstance(e, _Generation))
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise HpkitError(
                f"{where}: chat_template is not valid Jinja (line {exc.lineno}: {exc.message})"
            ) from None
        self.has_generation = "generation" in source and any(
            tag in source.replace(" ", "") for tag in ("{%generation%}", "{%-generation%}", "{%generation-%}")
        )

    @contextmanager
    def _tracking(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
        self._tracker.tracking = (blocks, spans)
        try:
            yield
        finally:
            self._tracker.tracking = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> Rendered:
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        try:
            with self._tracking(blocks, spans):
                for block in self._template.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, **self.special
                ):
                    blocks.append(block)
        except jinja2.exceptions.SecurityError as exc:
            raise HpkitError(
                f"{self.where}: chat_template refused: it reaches outside the sandbox ({exc})"
            ) from None
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateRefused(f"the chat template refuses it: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateRefused(f"the chat template fails on it ({type(exc).__name__}: {exc})") from None
        return Rendered("".join(blocks), spans)


def load_template(tokenizer_dir: str | Path) -> ChatTemplate:
    """The chat template of a tokenizer directory: chat_template.jinja, else tokenizer_config.json's."""
    directory = Path(tokenizer_dir)
    directory = directory if directory.is_dir() else directory.parent
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json_text.loads(config_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise HpkitError(f"{config_path}: not valid JSON ({exc})") from None
    special = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name)))}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: the default one, as transformers picks
        source = next(
            (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if not isinstance(source, str) or not source.strip():
        raise HpkitError(
            f"--tokenizer {tokenizer_dir}: {config_path.name} has no chat_template (nor is there a "
            "chat_template.jinja): use the instruct/chat model's tokenizer, or add its chat_template"
        )
    return ChatTemplate(source, special, str(config_path))


def _token_text(value: object) -> str | None:
    # transformers writes a special token as a string or as {"content": ..., ...} (an AddedToken).
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
