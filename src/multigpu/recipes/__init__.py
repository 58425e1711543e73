"""Training loops written against the Engine; each is a module that `multigpu run` can start."""

import logging


def _leave_out(logger: str, start: str) -> None:
    """Drops `logger`'s records whose message starts with `start`: lines the recipes' users have nothing to do about."""
    logging.getLogger(logger).addFilter(lambda record: not str(record.msg).startswith(start))


# bitsandbytes (imported by peft) warns on every CPU with AVX512-BF16 that it "Failed to load CPU gemm_4bit_forward
# from kernels-community ... pip install kernels": that package fetches kernels from the Hugging Face Hub at run
# time, which these recipes never do, and bitsandbytes falls back to its own kernel.
_leave_out("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community")
# DeepSpeed, imported by transformers as a model is written, warns on a machine without GPUs that it is "Setting
# accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it": the run knows it has none.
_leave_out("DeepSpeed", "Setting accelerator to CPU.")
