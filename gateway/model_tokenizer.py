"""A served model's own tokenizer and chat template, read from its files as vLLM renders them.

vLLM renders a chat with the model's Jinja chat template (`add_generation_prompt=True`, the special tokens'
strings as variables) and encodes the text adding no special tokens (the template wrote them); a completion's
prompt is encoded with the tokenizer's special tokens (a BOS, for most models). The gateway hashes the tokens
the engine will hash, so it does the same here with `tokenizers` and `jinja2` (what transformers uses), from
the model's `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`. Files are only ever read:
from a directory named by `--tokenizer-dir`, the model name itself when it is a local directory, the path an
engine's /v1/models gives as the model's `root`, or the Hugging Face cache (`HF_HUB_CACHE`, `HF_HOME/hub`,
`~/.cache/huggingface/hub`); nothing is downloaded.

A request this module cannot render exactly as vLLM would (tools, documents, a template or its arguments
from the request, content parts, tool calls) raises `NotRendered`: the caller asks the engine instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvproto.prefix_tokens import PrefixTokenCache

if TYPE_CHECKING:
    import jinja2

TOKENIZER_FILE = "tokenizer.json"
# Request fields that change what vLLM renders, which the gateway does not reproduce: such requests ask the engine.
CHAT_FIELDS_NOT_RENDERED = ("tools", "documents", "chat_template", "chat_template_kwargs", "continue_final_message")
_MESSAGE_KEYS = frozenset({"role", "content", "name"})
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class NotRendered(ValueError):
    """The gateway cannot make this request's tokens exactly as the engine will (the engine is to be asked)."""


def hf_cache_dirs() -> list[Path]:
    """The Hugging Face hub caches to look in, as huggingface_hub resolves them (first that is set)."""
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    home = Path(os.environ["HF_HOME"]) if os.environ.get("HF_HOME") else Path.home() / ".cache" / "huggingface"
    return [home / "hub"]


def _cached_snapshot(repo_id: str, cache: Path) -> Path | None:
    """The snapshot of `repo_id` (org/name) in a hub cache that `refs/main` names, else the only one there."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    try:
        ref = (repo / "refs" / "main").read_text().strip()
        snapshots = [repo / "snapshots" / ref] if ref else []
    except OSError:
        snapshots = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        snapshots = snapshots if len(snapshots) == 1 else []
    return next((s for s in snapshots if (s / TOKENIZER_FILE).is_file()), None)


def find_model_dir(model: str, root: str | None = None, tokenizer_dir: str = "") -> Path | None:
    """The directory holding `model`'s tokenizer files, if this machine has them; None otherwise.

    In order: `tokenizer_dir` itself (its files serve every model) or its subdirectory named `model`; then
    `model` and `root` (the engine's name for the model's files: a path, or a hub repo id) as local
    directories; then each as a repo id in the Hugging Face cache.
    """
    places = [Path(tokenizer_dir), Path(tokenizer_dir) / model] if tokenizer_dir else []
    names = [n for n in (model, root) if n]
    places += [Path(n).expanduser() for n in names]
    for place in places:
        try:
            if (place / TOKENIZER_FILE).is_file():
                return place
        except (OSError, ValueError):  # a name that is no path here
            continue
    for name in names:
        if name.count("/") == 1 and not name.startswith(("/", ".", "~")):
            for cache in hf_cache_dirs():
                found = _cached_snapshot(name, cache)
                if found is not None:
                    return found
    return None


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The model's default chat template: chat_template.jinja (newer transformers save it there), else
    tokenizer_config.json's `chat_template` (a string, or named templates of which "default")."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(
    x: object, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' `tojson` filter (Jinja's own escapes HTML characters, which a prompt must not have)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it (sandboxed, trim_blocks, lstrip_blocks, loop controls,
    its `raise_exception`, `tojson` and `strftime_now`), so it renders the same text. jinja2 is imported here, as
    `tokenizers` is in ModelTokenizer: a gateway without a model folder (and every test's) never loads either."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ModelTokenizer:
    """One model's tokenizer and chat template, loaded from `folder`; thread-safe (a tokenizer and a template are
    read-only; the prefix cache locks)."""

    def __init__(self, folder: str | Path, prefix_cache_entries: int = 0) -> None:
        from tokenizers import Tokenizer as _HF

        self.folder = Path(folder)
        self.name = f"model:{self.folder}"
        self._tok = _HF.from_file(str(self.folder / TOKENIZER_FILE))
        config = _read_json(self.folder / "tokenizer_config.json")
        specials_map = _read_json(self.folder / "special_tokens_map.json")
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL:
            text = _token_text(config.get(key, specials_map.get(key)))
            if text is not None:
                self.special_tokens[key] = text
        extra = config.get("additional_special_tokens", specials_map.get("additional_special_tokens"))
        self._additional = [t for t in (_token_text(x) for x in extra or ()) if t is not None]
        source = _chat_template(self.folder, config)
        self.template = compile_template(source) if source is not None else None
        self.prefix, self.suffix = self._special_frame(config)
        self._cache = PrefixTokenCache(self._tok, prefix_cache_entries)

    def _special_frame(self, config: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        """The ids encoding with special tokens puts before and after a text's own: the tokenizer.json
        post-processor's (transformers 5 ignores tokenizer_config.json's `add_bos_token` where there is one); without
        a post-processor, a BOS / EOS where tokenizer_config.json's `add_bos_token` / `add_eos_token` asks for one
        (transformers builds the post-processor from them then). The parity probe tells where this is wrong."""
        if self._tok.post_processor is not None:
            plain = self._tok.encode("a", add_special_tokens=False).ids
            full = self._tok.encode("a", add_special_tokens=True).ids
            at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
            return full[:at], full[at + len(plain) :]
        frame: list[list[int]] = []
        for key, flag in (("bos_token", "add_bos_token"), ("eos_token", "add_eos_token")):
            text = self.special_tokens.get(key)
            token_id = self._tok.token_to_id(text) if text is not None else None
            frame.append([token_id] if token_id is not None and config.get(flag) is True else [])
        return frame[0], frame[1]

    def encode_prompt(self, text: str, salt: str = "") -> list[int]:
        """A completion's prompt as vLLM's /v1/completions tokenizes it: with the special tokens (BOS)."""
        return [*self.prefix, *self._cache.encode(text, salt), *self.suffix]

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat as the model's template writes it; NotRendered where there is no template or it refused."""
        if self.template is None:
            raise NotRendered("the model has no chat template")
        from jinja2 import TemplateError

        try:
            return self.template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                additional_special_tokens=self._additional,
                **self.special_tokens,
            )
        except TemplateError as exc:  # the template refused the chat: the engine answers why
            raise NotRendered(f"the chat template refused the chat: {exc}") from exc

    def encode_chat(self, raw: Mapping[str, Any], salt: str = "") -> list[int]:
        """A chat request's tokens as vLLM's /v1/chat/completions makes them (rendered, no special tokens added);
        NotRendered for a request whose rendering the gateway does not reproduce (`renderable`)."""
        messages = renderable(raw)
        return self._cache.encode(self.render_chat(messages, raw.get("add_generation_prompt", True) is not False), salt)


def renderable(raw: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The messages of a chat request as the template is given them (string contents), or NotRendered for what
    vLLM would render otherwise than the gateway: the fields in CHAT_FIELDS_NOT_RENDERED, content parts (vLLM
    joins or passes them by the template's content format), tool calls (their arguments are parsed first)."""
    present = [f for f in CHAT_FIELDS_NOT_RENDERED if raw.get(f) not in (None, False, [], {})]
    if present:
        raise NotRendered(f"the request sets {', '.join(present)}")
    out = []
    for m in raw.get("messages") or ():
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str) or not set(m) <= _MESSAGE_KEYS:
            raise NotRendered("a message has content parts, tool calls or fields the gateway does not render")
        out.append(dict(m))
    return out
