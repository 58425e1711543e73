"""Training loops written against the Engine; each is a module that `multigpu run` can start."""

import logging

# bitsandbytes (imported by peft) warns on every CPU with AVX512-BF16 that it "Failed to load CPU gemm_4bit_forward
# from kernels-community ... pip install kernels": that package fetches kernels from the Hugging Face Hub at run
# time, which these recipes never do, and bitsandbytes falls back to its own kernel. Nothing to act on.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")
)
