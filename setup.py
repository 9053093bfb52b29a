from setuptools import find_packages, setup

setup(
    name="megatron_fused_ce",
    version="0.1.0",
    description="Fused vocab-parallel linear cross-entropy / log-probs for Megatron-Core "
    "(no [tokens, vocab/TP] logits tensor)",
    packages=find_packages(include=["megatron_fused_ce", "megatron_fused_ce.*"]),
    python_requires=">=3.10",
    # torch is not pinned here on purpose: install the wheel you want first (see README), so that a
    # loose requirement never pulls a multi-GB CUDA build on a CPU machine.
    # numpy: the CPU torch wheel does not require it, yet warns "Failed to initialize NumPy" on
    # every import without it.
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        # psutil: megatron-core's dist_checkpointing writer (the examples' --save) reads its memory with it
        "megatron": ["megatron-core>=0.16.1", "pyyaml", "tqdm", "psutil"],
        "triton": ["triton>=3.0"],
        # hypothesis pinned: its derandomized examples (tests/test_fuzz.py) depend on the version
        # pytest-xdist: the README's test command runs the suite in two processes (-n 2)
        "test": ["pytest>=7", "pytest-xdist>=3.2", "hypothesis==6.170.15", "megatron-core>=0.16.1", "triton>=3.0", "pyyaml",
                 "tqdm", "psutil", "einops", "tokenizers"],  # einops: megatron's Megatron-FSDP adapter (tests/test_megatron_fsdp.py)
        # examples/rollout.py --plot and the tools' PNGs; bench holds it too (its plots)
        "plot": ["matplotlib"],
        "bench": ["matplotlib", "triton>=3.0"],
        # QuACK's one-pass cross-entropy row kernel on Hopper (ops/cute_backend.py); quack-kernels
        # 0.6.5 imports with nvidia-cutlass-dsl 4.7.1, not 4.8
        "cute": ["quack-kernels==0.6.5", "nvidia-cutlass-dsl==4.7.1"],
        # tools/make_text_dataset.py (BPE tokenizer + indexed dataset of the stdlib sources)
        "data": ["tokenizers", "megatron-core>=0.16.1"],
    },
)
