"""gateway.model_tokenizer: a model's own tokenizer files and chat template, rendered and encoded as vLLM does.

The tokenizers are trained here as tests/compose/make_tiny_model.py trains the tiny model's (byte-level BPE with
<unk>, <s>, </s>), saved with the files transformers writes, so the test needs no download. The expected texts are
written out: what transformers' apply_chat_template renders of the template (trim_blocks, lstrip_blocks).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from gateway.cost import CostModel
from gateway.model_tokenizer import ModelTokenizer, NotRendered, find_model_dir
from gateway.policy import make_policy
from gateway.prefix_hasher import PrefixHasher
from gateway.router import Router
from gateway.tokenizer_parity import first_difference
from gateway.tokenizers import ModelFilesTokenizer, fixed_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog while a support assistant answers briefly"] * 50
TINY_TEMPLATE = (  # the tiny model's (tests/compose/make_tiny_model.py)
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# A Llama-3-like template: BOS from the variables, whitespace rules in play, a refusal, the tojson filter.
BOS_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
    <|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " the quick fox? "}]


def _train() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return tok


def _model_dir(
    root: Path, *, bos_processor: bool, template: str | None, config: dict[str, object] | None = None, jinja_file: bool = True
) -> Path:
    tok = _train()
    if bos_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    cfg: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "unk_token": "<unk>"}
    if template is not None and jinja_file:
        (root / "chat_template.jinja").write_text(template)
    elif template is not None:
        cfg["chat_template"] = [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": template}]
    (root / "tokenizer_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("m") / "tiny", bos_processor=False, template=TINY_TEMPLATE)


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("m") / "llama", bos_processor=True, template=BOS_TEMPLATE, jinja_file=False)


def _plain(folder: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_the_tiny_models_chat_is_its_template_with_no_special_tokens_added(tiny: Path) -> None:
    mt = ModelTokenizer(tiny)
    text = "<|system|>be brief\n<|user|> the quick fox? \n<|assistant|>"
    assert mt.render_chat(CHAT) == text
    assert mt.encode_chat({"messages": CHAT}) == _plain(tiny, text)
    assert mt.encode_chat({"messages": CHAT, "add_generation_prompt": False}) == _plain(tiny, text.removesuffix("<|assistant|>"))
    assert mt.encode_prompt("the lazy dog") == _plain(tiny, "the lazy dog")  # its tokenizer adds no BOS


def test_a_bos_model_gets_its_bos_from_the_template_in_chats_and_from_the_tokenizer_in_completions(llama_like: Path) -> None:
    mt = ModelTokenizer(llama_like)
    # As transformers' apply_chat_template renders it (5.19, checked by hand): trim_blocks and lstrip_blocks drop
    # the block tags' lines and indents, not the text lines' own.
    text = "<s>\n    <|system|>be brief</s>\n    <|user|>the quick fox?</s>\n<|assistant|>"
    assert mt.render_chat(CHAT) == text
    chat = mt.encode_chat({"messages": CHAT})
    assert chat == _plain(llama_like, text) and chat.count(1) == 1  # one BOS: the template's, none added on encode
    assert mt.encode_prompt("the lazy dog") == [1, *_plain(llama_like, "the lazy dog")]


@pytest.mark.parametrize(("flag", "bos"), [(True, [1]), (False, []), (None, [])])
def test_without_a_post_processor_add_bos_token_says_whether_a_completion_opens_with_bos(
    tmp_path: Path, flag: bool | None, bos: list[int]
) -> None:
    config: dict[str, object] = {} if flag is None else {"add_bos_token": flag}
    folder = _model_dir(tmp_path / "m", bos_processor=False, template=None, config=config)
    assert ModelTokenizer(folder).encode_prompt("the fox") == [*bos, *_plain(folder, "the fox")]


def test_a_post_processor_wins_over_add_bos_token_as_in_transformers_5(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path / "m", bos_processor=True, template=None, config={"add_bos_token": False})
    assert ModelTokenizer(folder).encode_prompt("the fox")[0] == 1


@pytest.mark.parametrize(
    "raw",
    [
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
        {"messages": [{"role": "tool", "content": "42"}]},  # the template refuses it (raise_exception)
    ],
)
def test_what_the_gateway_cannot_render_exactly_is_left_to_the_engine(llama_like: Path, raw: dict[str, object]) -> None:
    with pytest.raises(NotRendered):
        ModelTokenizer(llama_like).encode_chat(raw)


def test_a_model_without_a_chat_template_asks_the_engine_for_chats(tmp_path: Path) -> None:
    mt = ModelTokenizer(_model_dir(tmp_path / "m", bos_processor=False, template=None))
    with pytest.raises(NotRendered):
        mt.encode_chat({"messages": CHAT})


def test_long_chats_reuse_their_history_and_still_make_the_same_ids(tiny: Path) -> None:
    cached, whole = ModelTokenizer(tiny, prefix_cache_entries=8), ModelTokenizer(tiny)
    history = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 40}]
    for turn in range(3):
        history += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"and then {turn}?"}]
        assert cached.encode_chat({"messages": history}) == whole.encode_chat({"messages": history})
    assert cached._cache.tokenized_chars < 3 * len(cached.render_chat(history)) / 2  # the history was reused


def test_the_models_files_are_found_by_path_by_engine_root_and_in_the_hf_cache(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert find_model_dir(str(tiny)) == tiny  # the model name is a local directory
    assert find_model_dir("tiny", root=str(tiny)) == tiny  # vLLM's --served-model-name, its /v1/models root
    assert find_model_dir("tiny") is None
    hub = tmp_path / "hf" / "hub" / "models--acme--tiny-chat"
    for rev in ("aaa", "bbb"):
        (hub / "snapshots" / rev).mkdir(parents=True)
        (hub / "snapshots" / rev / "tokenizer.json").write_text((tiny / "tokenizer.json").read_text())
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("bbb")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert find_model_dir("acme/tiny-chat") == hub / "snapshots" / "bbb"  # the snapshot refs/main names
    assert find_model_dir("served-name", root="acme/tiny-chat") == hub / "snapshots" / "bbb"
    assert find_model_dir("acme/other") is None


def test_tokenizer_setting_names_a_model_directory_bytes_a_file_or_nothing_fixed(tiny: Path) -> None:
    assert isinstance(fixed_tokenizer(str(tiny)), ModelFilesTokenizer)
    assert fixed_tokenizer("bytes") is not None and fixed_tokenizer("auto") is None and fixed_tokenizer("engine") is None
    with pytest.raises(ValueError, match="a model directory, 'auto' or 'engine'"):
        fixed_tokenizer("/no/such/tokenizer")


def test_first_difference_names_the_index_and_both_lengths() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3, 4]) == "first differing token at 1 (gateway 3 tokens, engine 4)"
    assert first_difference([1, 2], [1, 2, 3]) == "first differing token at 2 (gateway 2 tokens, engine 3)"


def test_the_router_hashes_at_the_block_size_it_is_given() -> None:
    router = Router(make_policy("kvdir", cost=CostModel()), random.Random(0), PrefixHasher(16))
    tokens = list(range(100)) * 30  # past one checkpoint stride at 16 (64 blocks): checkpoints of both sizes kept
    at16, at32 = router.hashes(tokens), router.hashes(tokens, None, 32)
    assert at16 == PrefixHasher(16).hashes(tokens) and at32 == PrefixHasher(32).hashes(tokens)
    assert router.hashes(tokens, None, 32) == at32 and router.hashes(tokens, None, 16) == at16  # from checkpoints
    assert router.request(len(tokens), at32, 8, block_size=32).block_size == 32
    assert router.request(len(tokens), at16, 8).block_size == 16
