"""Canzona: matrix-based optimizers inside Megatron-Core's data and tensor parallelism."""

from setuptools import setup

setup(
    name="canzona",
    version="0.1.0",
    description="Muon, Shampoo and SOAP under Megatron-Core data and tensor parallelism",
    python_requires=">=3.12",
    # `megatron` is a namespace package owned by megatron-core; we add megatron.canzona.
    packages=[
        "megatron.canzona",
        "megatron.canzona.planning",
        "megatron.canzona.planning.sim",
        "megatron.canzona.optim",
        "megatron.canzona.data",
        "megatron.canzona.runtime",
        "canzona_patches",
        "canzona_patches.emulation",
        "canzona_patches.integration",
        "canzona_patches.checkpoints",
        "canzona_patches.harness",
    ],
    # The training entry point, importable by the tools that build its model (tools/convert_hf.py).
    py_modules=["pretrain_gpt"],
    package_data={"megatron.canzona.planning.sim": ["clusters/*.toml"], "canzona_patches": ["patches.toml"],
                  "megatron.canzona.optim": ["ns_coefficients.toml"]},
    install_requires=["torch", "megatron-core==0.19.2", "numpy"],
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "test": ["pytest", "pytest-timeout", "hypothesis"],
        "wandb": ["wandb"],
    },
)
