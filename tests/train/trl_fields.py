"""Dumps every field of TRL 0.29.1's configuration classes kiln's trainers follow
(SFTConfig, DPOConfig, CPOConfig for simpo, ORPOConfig, KTOConfig, GRPOConfig, RewardConfig, RLOOConfig, GKDConfig for distill, BCOConfig, OnlineDPOConfig, PPOConfig; SFTConfig again for pretrain) into
runtime/src/train/trl_fields.json: for each kiln task, each field's name, whether TRL itself
declares it (the class or TRL's BaseConfig) or transformers' TrainingArguments does, its
dataclass default and the value `Config().to_dict()` holds for it (after __post_init__).

kiln reads the file (runtime/src/train/fields.rs): a field kiln does not implement is accepted at
TRL's default and refused by name otherwise, and a test checks that every field listed here is
either implemented or refused for a stated reason.

    venv/bin/pip install -r tests/train/requirements.txt
    venv/bin/python tests/train/trl_fields.py
"""

import dataclasses
import json
import math
import os
import tempfile

import transformers
import trl
from transformers import TrainingArguments
from trl import DPOConfig, GRPOConfig, RewardConfig, RLOOConfig, SFTConfig
from trl.experimental.cpo import CPOConfig
from trl.experimental.bco import BCOConfig
from trl.experimental.gkd import GKDConfig
from trl.experimental.online_dpo import OnlineDPOConfig
from trl.experimental.ppo import PPOConfig
from trl.experimental.kto import KTOConfig
from trl.experimental.orpo import ORPOConfig
from trl.trainer.base_config import BaseConfig

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "runtime", "src", "train",
                   "trl_fields.json")
TASKS = {"sft": SFTConfig, "dpo": DPOConfig, "simpo": CPOConfig, "orpo": ORPOConfig, "kto": KTOConfig, "reward": RewardConfig, "rloo": RLOOConfig, "pretrain": SFTConfig, "distill": GKDConfig,
         "bco": BCOConfig, "online_dpo": OnlineDPOConfig, "ppo": PPOConfig,
         "grpo": GRPOConfig}


def plain(v):
    """A JSON value for a default (enums by value, infinities as strings)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if hasattr(v, "value") and not isinstance(v, (int, float, str, bool)):
        return v.value
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def default(f):
    if f.default is not dataclasses.MISSING:
        return plain(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return plain(f.default_factory())
    return None


def declared_by_trl(cls, name):
    """Whether TRL declares the field (the class itself, a TRL base, or BaseConfig)."""
    for klass in cls.__mro__:
        if klass is TrainingArguments:
            return False
        if name in klass.__dict__.get("__annotations__", {}):
            return True
    return False


def main():
    out = {"_versions": {"trl": trl.__version__, "transformers": transformers.__version__}}
    for task, cls in TASKS.items():
        with tempfile.TemporaryDirectory() as d:
            inst = cls(output_dir=d, use_cpu=True).to_dict()
        fields = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            fields[f.name] = {
                "trl": declared_by_trl(cls, f.name),
                "default": default(f),
                # The instance's output_dir is the temporary folder given above.
                "to_dict": None if f.name == "output_dir" else plain(inst.get(f.name)),
            }
        out[task] = {"class": cls.__name__, "fields": fields}
        print(task, cls.__name__, len(fields), "fields,", sum(v["trl"] for v in fields.values()), "TRL's own")
    with open(OUT, "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=False)
        fh.write("\n")


if __name__ == "__main__":
    main()
