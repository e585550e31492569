"""Install entry point for stapo (Spurious-Token-Aware Policy Optimization)."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent

setup(
    name="stapo",
    version="0.1.0",
    description="STAPO: RL for LLMs on verifiable math rewards with spurious-token silencing",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["stapo", "stapo.*"]),
    package_data={"stapo": ["recipes/*.yaml"]},
    install_requires=[
        "torch>=2.4",
        "transformers>=4.51",
        "datasets>=2.19",
        "accelerate>=1.0",
        "deepspeed>=0.16",
        "sympy>=1.12",
        "pyyaml>=6.0",
        "rich>=13.0",
        "matplotlib>=3.7",
        "tensorboard>=2.14",
        "tokenizers>=0.19",
        "pyarrow>=14.0",
        "pyseccomp>=0.1.2; sys_platform == 'linux'",  # the python tool's seccomp filter (libseccomp.so.2; docs/tools.md)
    ],
    extras_require={
        "vllm": ["vllm>=0.26,<0.33"],  # weight-update session read against 0.26, run on the CPU build 0.32
        "lora": ["peft>=0.17,<0.22"],  # model.lora (stapo/distributed/lora.py); tested with 0.21.2
        "test": ["pytest>=8.0", "hypothesis>=6.100", "pytest-timeout>=2.3", "peft>=0.17,<0.22"],
        "bench": ["math-verify==0.8.0", "trl==1.16.0", "psutil>=5.9"],
    },
    entry_points={"console_scripts": ["stapo=stapo.cli:run"]},
)
