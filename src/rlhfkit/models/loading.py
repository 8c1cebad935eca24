"""Loading tokenizers, causal LMs and scalar (reward / value) models from a folder or a hub id.

Rules (docs/design.md, "Models"):
- ``trust_remote_code`` is False unless the caller sets it, so no code from a model folder runs
  by default;
- weights come from safetensors only (``use_safetensors=True``): a folder with nothing but
  pickled ``pytorch_model.bin`` weights is refused with a message that says so;
- ``dtype`` is the *compute* precision: ``"auto"`` means float32 on CPU and bfloat16 when a CUDA GPU
  that supports it is present (the ``model.dtype`` help in rlhfkit.config). A model loaded to be trained
  keeps float32 weights and runs under bf16 autocast; only a ``frozen=True`` model holds bf16 weights
  (:mod:`rlhfkit.models.precision`);
- a tokenizer without a pad token is resolved explicitly by :func:`load_tokenizer`'s
  ``missing_pad`` argument, never silently; the embedding rows a model grows for it are the mean of
  its existing rows, so every role loaded from one checkpoint gets the same ones (a random row per
  role made the step-0 KL between actor and reference non-zero);
- ``chat_template`` (a Jinja string or a file) replaces the tokenizer's own;
- a LoRA adapter folder (peft's ``adapter_config.json``) loads as its base with the adapter merged in
  (:mod:`rlhfkit.models.lora`), wherever a model folder is expected.

Scalar models are ``AutoModelForSequenceClassification`` with ``num_labels=1``. Loaded from a
causal-LM folder (a reward model's backbone), the new ``score`` head is initialised with
std 1/sqrt(d_model + 1) (Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO";
Ziegler et al. 2019 reward model init).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from typing import Literal

import torch

from rlhfkit.engine.accel import auto_precision
from rlhfkit.errors import UserError
from rlhfkit.models.lora import adapter_base, merge_adapter_folder
from rlhfkit.models.precision import autocast_forward, float32_attention_on_cpu, warn_slow_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAD_TOKEN = "<|pad|>"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"auto"`` -> bfloat16 on a CUDA machine that supports it, else float32;
    ``"float32" | "bfloat16" | "float16"`` or a torch dtype as given."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return DTYPES[auto_precision()]
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype '{dtype}': use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


# A Hub model name as huggingface_hub accepts one: an optional namespace, then the name (letters, digits, - _ .).
HUB_NAME = re.compile(r"^(?:[\w.-]{1,96}/)?[\w.-]{1,96}$")


def check_model_path(name_or_path: str, what: str = "model") -> None:
    """Refuse, at once and without asking the Hub, a model path that cannot load: a local-looking path that is
    not a folder (``./x``, ``/x``, ``~/x``, ``a/b/c``, or ``a/b`` where ``a`` is a local folder: a typo in
    ``models/smollm2``), named with its closest neighbours; or a name that is no Hub model name either."""
    path = os.fspath(name_or_path)
    full = os.path.expanduser(path)
    if os.path.isdir(full):
        return
    head = path.split("/", 1)[0]
    looks_local = (
        path.startswith((".", "/", "~"))
        or path.count("/") > 1
        or (os.sep != "/" and os.sep in path)
        or ("/" in path and os.path.isdir(os.path.expanduser(head)))
        or os.path.exists(full)
    )
    if looks_local:
        what_is = "is a file, not a folder" if os.path.exists(full) else "does not exist"
        raise UserError(f"{what} folder not found: {path} ({what_is}){_neighbours(full)}")
    if not HUB_NAME.match(path) or "--" in path or ".." in path or path.endswith(".git"):
        raise UserError(
            f"{what} '{path}' is neither a local folder nor a Hub model name ('namespace/name', e.g. "
            "HuggingFaceTB/SmolLM2-135M-Instruct)"
        )


def _neighbours(full: str) -> str:
    """``; did you mean ...`` with the folders beside a missing one whose names are close to its name."""
    parent, name = os.path.split(full.rstrip("/"))
    try:
        folders = [f for f in os.listdir(parent or ".") if os.path.isdir(os.path.join(parent or ".", f))]
    except OSError:
        return ""
    close = difflib.get_close_matches(name, folders, n=3)
    return f"; did you mean {' or '.join(repr(os.path.join(parent, c)) for c in close)}?" if close else ""


def _load(what: str, name_or_path: str, loader, **kwargs):
    """Call a transformers ``from_pretrained`` and turn its input errors into a UserError."""
    check_model_path(name_or_path, what)
    try:
        return loader(os.path.expanduser(os.fspath(name_or_path)), **kwargs)
    except (OSError, ValueError) as error:
        hint = ""
        if "safetensors" in str(error) or "model.safetensors" in str(error):
            hint = " (rlhfkit loads safetensors weights only; convert pickled .bin weights first)"
        raise UserError(f"cannot load {what} from '{name_or_path}': {error}{hint}") from error


def load_tokenizer(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    missing_pad: Literal["add", "eos"] = "add",
    chat_template: str | None = None,
):
    """Load a tokenizer and make sure it has a pad token and an EOS token.

    Args:
        name_or_path: local folder or hub id.
        trust_remote_code: allow custom tokenizer code from the folder (off by default).
        missing_pad: what to do when the tokenizer has no pad token.
            ``"add"`` adds a distinct special token ``<|pad|>``; the models loaded with this
            tokenizer (``tokenizer=`` below) grow their embeddings by one row. The policy can
            then in principle sample ``<|pad|>``; generation should suppress it.
            ``"eos"`` reuses EOS as pad, which is safe inside rlhfkit (masks come from lengths and
            attention masks, never from comparing ids with the pad id); a reward model saved with
            :func:`save_hf_folder` still gets a distinct pad token for plain transformers.
        chat_template: a Jinja template or the path of a file holding one (:func:`read_chat_template`);
            it replaces the tokenizer's own.
    Returns:
        a ``transformers`` tokenizer with ``pad_token_id`` and ``eos_token_id`` set.
    """
    from transformers import AutoTokenizer

    if missing_pad not in ("add", "eos"):
        raise UserError(f"missing_pad must be 'add' or 'eos', got '{missing_pad}'")
    base = adapter_base(name_or_path)
    if base is not None and not os.path.isfile(
        os.path.join(os.path.expanduser(name_or_path), "tokenizer_config.json")
    ):
        name_or_path = base  # an adapter folder saved without its tokenizer: the base model's
    tokenizer = _load(
        "tokenizer", name_or_path, AutoTokenizer.from_pretrained, trust_remote_code=trust_remote_code
    )
    if tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer in '{name_or_path}' has no EOS token; set eos_token in its config")
    if tokenizer.pad_token_id is None:
        if missing_pad == "add":
            tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        else:
            tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """A chat template given as a Jinja string or as the path of a file holding one, checked to compile.

    A value with ``{{`` or ``{%`` in it is a template; anything else must be an existing file.
    """
    import jinja2

    text, source = value, "data.chat_template"
    if "{{" not in value and "{%" not in value:
        path = os.path.expanduser(value)
        if not os.path.isfile(path):
            raise UserError(
                f"data.chat_template: '{value}' is neither a Jinja template (no '{{{{' or '{{%') nor "
                "an existing file"
            )
        with open(path, encoding="utf-8") as f:
            text, source = f.read(), f"data.chat_template file {value}"
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as error:
        raise UserError(
            f"{source}: not a valid Jinja template (line {error.lineno}: {error.message})"
        ) from None
    return text


def match_tokenizer(model: torch.nn.Module, tokenizer) -> torch.nn.Module:
    """Grow the embeddings to the tokenizer's size (an added pad token) and record its pad id.

    Args:
        model: a Hugging Face model (modified in place and returned).
        tokenizer: the tokenizer the model will be fed with.
    """
    if tokenizer is None:
        return model
    old_rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > old_rows:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        _mean_new_rows(model, old_rows)
    model.config.pad_token_id = tokenizer.pad_token_id
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _mean_new_rows(model: torch.nn.Module, old_rows: int) -> None:
    """Set the embedding rows past ``old_rows`` (input, and output when untied) to the mean of the old ones.

    Deterministic, so the actor, the reference, the critic and the reward model loaded from one checkpoint
    all get the same rows (transformers draws them at random, differently for each role).
    """
    with torch.no_grad():
        for embedding in (model.get_input_embeddings(), model.get_output_embeddings()):
            weight = getattr(embedding, "weight", None)
            if weight is None or weight.shape[0] <= old_rows:
                continue
            weight[old_rows:] = weight[:old_rows].float().mean(0).to(weight.dtype)
            bias = getattr(embedding, "bias", None)
            if bias is not None and bias.shape[0] > old_rows:
                bias[old_rows:] = bias[:old_rows].float().mean().to(bias.dtype)


def weight_dtype(dtype: str | torch.dtype, frozen: bool) -> torch.dtype:
    """The dtype a model's weights are loaded in: the compute dtype for a frozen model, float32 for a
    trained one (its optimizer needs float32 master weights; float64, asked for exactness, stays float64)."""
    resolved = resolve_dtype(dtype)
    return resolved if frozen or resolved == torch.float64 else torch.float32


def _finish(model, dtype, tokenizer, dropout: bool):
    """Shared tail of the loaders: the tokenizer's rows and pad id, dropout off, autocast when bf16."""
    match_tokenizer(model, tokenizer)
    if not dropout:
        disable_dropout(model)
    compute = resolve_dtype(dtype)
    if compute in (torch.bfloat16, torch.float16):  # half precision: float32 weights, half-precision forwards
        autocast_forward(model, compute)
        if not torch.cuda.is_available():  # on a GPU machine the attention stays transformers' own
            float32_attention_on_cpu(model)
            warn_slow_bf16("cpu")
    return model


def load_causal_lm(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    dtype: str | torch.dtype = "auto",
    tokenizer=None,
    dropout: bool = False,
    frozen: bool = False,
):
    """Load a causal LM (``AutoModelForCausalLM``) from safetensors.

    Args:
        name_or_path: local folder or hub id.
        trust_remote_code: allow custom model code from the folder (off by default).
        dtype: the compute precision: ``"auto"`` (see :func:`resolve_dtype`), ``"float32"``, ``"bfloat16"``
            or a torch dtype. Below float32, every forward runs under autocast.
        tokenizer: when given, embeddings are resized to it and its pad id is recorded.
        dropout: keep the model's dropout; RLHF turns it off in all four roles (trl#454), the default.
        frozen: the model is never trained (a reference, a sampler): its weights are loaded in ``dtype``;
            otherwise they stay float32 (:func:`weight_dtype`).
    """
    from transformers import AutoModelForCausalLM

    base = adapter_base(name_or_path)
    if base is not None:  # a LoRA adapter folder: its base with the adapter merged in
        model = load_causal_lm(
            base, trust_remote_code=trust_remote_code, dtype=dtype, tokenizer=tokenizer, dropout=dropout
        )
        return merge_adapter_folder(model, name_or_path).to(weight_dtype(dtype, frozen))  # merged in float32
    model = _load(
        "causal LM",
        name_or_path,
        AutoModelForCausalLM.from_pretrained,
        trust_remote_code=trust_remote_code,
        dtype=weight_dtype(dtype, frozen),
        use_safetensors=True,
    )
    return _finish(model, dtype, tokenizer, dropout)


def init_score_head(model: torch.nn.Module) -> None:
    """Initialise ``model.score`` with N(0, 1/(d_model + 1)) weights and a zero bias.

    Source: Huang et al. 2024 ("The N+ Implementation Details of RLHF with PPO"), detail "reward
    head initialisation", following Ziegler et al. 2019 (lm-human-preferences).
    """
    head = model.score
    with torch.no_grad():
        head.weight.normal_(mean=0.0, std=1.0 / math.sqrt(head.in_features + 1))
        if head.bias is not None:
            head.bias.zero_()


def load_scalar_model(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    dtype: str | torch.dtype = "auto",
    tokenizer=None,
    dropout: bool = False,
    frozen: bool = False,
):
    """Load a reward / value model: ``AutoModelForSequenceClassification`` with one label.

    A folder saved as a sequence classifier must have ``num_labels == 1`` (else a UserError). A
    causal-LM folder becomes the backbone of a new scalar model whose ``score`` head is
    initialised by :func:`init_score_head` (for reward-model training).

    Args:
        name_or_path: local folder or hub id.
        trust_remote_code, dtype, tokenizer, dropout, frozen: as in :func:`load_causal_lm`.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    base = adapter_base(name_or_path)
    if base is not None:  # a LoRA adapter folder: its base with the adapter (and a trained head) merged in
        model = load_scalar_model(
            base, trust_remote_code=trust_remote_code, dtype=dtype, tokenizer=tokenizer, dropout=dropout
        )
        return merge_adapter_folder(model, name_or_path).to(weight_dtype(dtype, frozen))  # merged in float32
    config = _load(
        "model config", name_or_path, AutoConfig.from_pretrained, trust_remote_code=trust_remote_code
    )
    architectures = getattr(config, "architectures", None) or []
    is_classifier = any(name.endswith("ForSequenceClassification") for name in architectures)
    if is_classifier and config.num_labels != 1:
        raise UserError(
            f"'{name_or_path}' is a classifier with num_labels={config.num_labels}; "
            "a reward or value model needs num_labels=1"
        )
    model, info = _load(
        "scalar model",
        name_or_path,
        AutoModelForSequenceClassification.from_pretrained,
        trust_remote_code=trust_remote_code,
        dtype=weight_dtype(dtype, frozen),
        use_safetensors=True,
        num_labels=1,
        output_loading_info=True,
    )
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        raise UserError(f"{type(model).__name__} has no linear `score` head; rlhfkit cannot read its scores")
    if any(key.split(".")[0] == "score" for key in info["missing_keys"]):
        init_score_head(model)
    if tokenizer is None and model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return _finish(model, dtype, tokenizer, dropout)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Turn off every dropout: ``nn.Dropout`` modules, float ``*dropout*`` attributes that attention
    code reads directly (Llama's ``attention_dropout``), and the matching config fields.

    Dropout makes the PPO ratio differ from 1 before any update (huggingface/trl#454).
    """
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for name, value in list(vars(config).items()):
            if ("dropout" in name or name.endswith("_pdrop")) and isinstance(value, float):
                setattr(config, name, 0.0)
    return model
