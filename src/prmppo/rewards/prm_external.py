"""`reward=prm_external`: the process reward of `reward=prm` with the step scores of an off-the-shelf PRM
checkpoint (`reward.path`, `reward.format`; models/external_prm.py) instead of one prmppo trains.

Everything after the scores is `ProcessReward`'s (noise, transform, weights, outcome term, monitors), so both
arms and every transform work as with the trained PRM. No PRM stage runs (`needs_learned_prm` is False).
The launch gate `check_load` reads the checkpoint's config and tokenizer (no weights); the PPO stage then
asks `make_step_scorer` for the loaded scorer on `reward.device` (or the trainer's device).

    python -m prmppo task=jsonl ... arm=prm reward=prm_external reward.path=/ckpt/math-shepherd-prm
"""

from __future__ import annotations

from prmppo.config.schema import ExternalProcessRewardConfig
from prmppo.models.external_prm import check_external_prm, load_external_scorer
from prmppo.rewards.prm import ProcessReward


class ExternalProcessReward(ProcessReward):
    """`ProcessReward` whose step scorer is an external PRM checkpoint."""

    def __init__(self, path: str, format: str = ExternalProcessRewardConfig.format,  # noqa: A002 - the config key
                 device: str = ExternalProcessRewardConfig.device, dtype: str = ExternalProcessRewardConfig.dtype,
                 micro_batch_rows: int = ExternalProcessRewardConfig.micro_batch_rows,
                 scorer: str = ExternalProcessRewardConfig.scorer, **process):
        if scorer != "external":
            raise ValueError(f"reward.scorer={scorer!r}: reward=prm_external scores steps with reward.path's PRM "
                             "(scorer=external); use reward=prm for the other scorers")
        if micro_batch_rows < 1:
            raise ValueError(f"reward.micro_batch_rows={micro_batch_rows} must be >= 1")
        super().__init__(**process)
        self.scorer = scorer
        self.path, self.format, self.device, self.dtype = path, format, device, dtype
        self.micro_batch_rows = micro_batch_rows

    def check_load(self) -> dict:
        """The launch gate: the checkpoint is whole and speaks `reward.format` (no weights read)."""
        check_external_prm(self.path, self.format)
        return {"path": self.path, "format": self.format}

    def make_step_scorer(self, task, tokenizer, train_device: str):
        """The loaded external PRM as a step scorer of the policy's responses (`tokenizer`: the policy's)."""
        return load_external_scorer(self.path, self.format, self.device or train_device, self.dtype, tokenizer,
                                    task.step_delimiter, self.micro_batch_rows)
