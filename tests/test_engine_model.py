"""Our forward equals transformers' model; unsupported checkpoints fail loudly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.engines import LLAMA3_SCALING, max_diff, random_tokens

from tessera.config import ModelConfig
from tessera.engines.checkpoint import load_config_dict, resolve
from tessera.engines.model import Item, Model
from tessera.engines.rope import RopeSpec
from tessera.engines.tiny import write_tiny_checkpoint
from tessera.engines.weights import ModelSpec
from tessera.errors import ModelLoadError

CPU = torch.device("cpu")


def load_ours(path: Path) -> Model:
    spec = ModelSpec.from_config(json.loads((path / "config.json").read_text()))
    return Model.load(path, spec, torch.float32, CPU)


def prefill_logits(model: Model, tokens: tuple[int, ...]) -> torch.Tensor:
    """Next-token logits after a plain prefill of ``tokens`` into fresh slots."""
    s = model.spec
    slots = torch.empty(s.n_layers, len(tokens), s.n_kv_heads, s.head_dim)
    kv = (slots, torch.empty_like(slots))
    return model.forward([Item(tokens, range(len(tokens)), kv=kv, logits=True)])[0]


def hf_logits(path: Path, tokens: tuple[int, ...]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize(
    ("arch", "opts"),
    [("llama", {}), ("llama", {"rope_scaling": LLAMA3_SCALING}), ("qwen2", {}), ("qwen3", {})],
    ids=["llama", "llama3-rope-scaling", "qwen2", "qwen3"],
)
def test_prefill_logits_match_transformers(tmp_path: Path, arch: str, opts: dict[str, object]) -> None:
    """Full-prefill logits of a tiny random checkpoint equal transformers' own model."""
    path = write_tiny_checkpoint(tmp_path, arch, seed=3, **opts)
    tokens = random_tokens(200, seed=1)
    ours = prefill_logits(load_ours(path), tokens)
    assert max_diff(ours, hf_logits(path, tokens)) < 1e-4


def test_llama3_scaling_changes_the_frequencies_like_transformers(tmp_path: Path) -> None:
    """Our llama3 inverse frequencies equal transformers' and differ from unscaled RoPE."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = write_tiny_checkpoint(tmp_path, "llama", rope_scaling=LLAMA3_SCALING)
    spec = ModelSpec.from_config(json.loads((path / "config.json").read_text()))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(str(path)), CPU)
    assert torch.equal(spec.rope.inv_freq(), theirs)
    assert not torch.allclose(spec.rope.inv_freq(), RopeSpec(head_dim=spec.head_dim).inv_freq())


@pytest.mark.model
def test_smollm2_prefill_matches_transformers() -> None:
    """The bundled SmolLM2-135M gives transformers' logits on a real chat prompt."""
    ck = resolve(ModelConfig())
    model = Model.load(ck.path, ModelSpec.from_config(load_config_dict(ck)), torch.float32, CPU)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ck.path))
    text = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe and one fact each."}],
                                   tokenize=False, add_generation_prompt=True)
    tokens = tuple(tok.encode(text, add_special_tokens=False))
    ours, theirs = prefill_logits(model, tokens), hf_logits(ck.path, tokens)
    assert max_diff(ours, theirs) < 1e-3
    assert int(ours.argmax()) == int(theirs.argmax())


def _config_with(tmp_path: Path, **changes: object) -> dict[str, object]:
    path = write_tiny_checkpoint(tmp_path, "qwen2")
    config: dict[str, object] = json.loads((path / "config.json").read_text())
    config.update(changes)
    return config


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "not supported"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True, "sliding_window": 32}, "sliding-window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_checkpoints_fail_loudly(tmp_path: Path, changes: dict[str, object], needle: str) -> None:
    """Architectures and features we do not implement raise ModelLoadError naming the reason."""
    with pytest.raises(ModelLoadError, match=needle):
        ModelSpec.from_config(_config_with(tmp_path, **changes))


def test_missing_or_misshapen_weights_fail_loudly(tmp_path: Path) -> None:
    """A config that does not match the weights names the offending tensor."""
    path = write_tiny_checkpoint(tmp_path, "llama")
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="has shape"):
        Model.load(path, ModelSpec.from_config({**config, "intermediate_size": 96}), torch.float32, CPU)
    with pytest.raises(ModelLoadError, match="q_norm"):
        Model.load(path, ModelSpec.from_config({**config, "architectures": ["Qwen3ForCausalLM"]}), torch.float32, CPU)
