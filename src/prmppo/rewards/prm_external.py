"""`reward=prm_external`: the process reward of `reward=prm` with the step scores of an off-the-shelf PRM
checkpoint (`reward.path`, `reward.format`; models/external_prm.py) instead of one prmppo trains.

Everything after the scores is `ProcessReward`'s (noise, transform, weights, outcome term, monitors), so both
arms and every transform work as with the trained PRM. No PRM stage runs (`needs_learned_prm` is False).
This module holds the settings only: the launch gate (`models.external_prm.check_external_reward`) reads the
checkpoint's config and tokenizer (no weights), and the PPO stage loads the scorer
(`models.external_prm.external_step_scorer`) on `reward.device` (or the trainer's device); `rewards/` sits
below `models/`, so it imports nothing from there.

    python -m prmppo task=jsonl ... arm=prm reward=prm_external reward.path=/ckpt/math-shepherd-prm
"""

from __future__ import annotations

from prmppo.config.schema import ExternalProcessRewardConfig
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
