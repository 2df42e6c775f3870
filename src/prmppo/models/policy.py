"""The trainable policy, its frozen reference and its value head (models/value_head.py), on one resident base.

`lora=adapter` -> `LoraPolicy`: a peft LoRA adapter named `policy` on the base model. The
reference policy is the same model with adapters disabled, so no second copy of the weights
exists; a later `prm` adapter lives on the same base. `lora=none` -> `FullPolicy`: every base
weight trains and a frozen deep copy is the reference; the `prm` adapter joins that copy (the
trained weights keep moving), so the reference runs it with every adapter switched off
(`adapters_off`). Either way the reference's logits are the SFT base's, whatever PRM is loaded:
`guards.gates.check_reference` verifies this at build time, through `reference_score`, the path the
KL reads.

Both expose the same surface to the PPO loop: `score` (logprobs of the taken response tokens,
their entropies and values, computed from the final hidden states in chunks through the LM head so
that no [B, T, V] logit tensor exists: models/token_scores.py), `reference_score` (the same logprobs
under the reference, no grad: what the KL reads), `forward` / `reference_logits` (full logits, for
tests and benchmarks), `enable_gradient_checkpointing`, `compile_decoder_layers`, `policy_parameters`, `value_parameters`, `save_merged`
(an HF-layout directory of the current policy, for the checkpoint sync and for evaluation) and
`save_adapter` (the adapter sync).
LoRA factors are kept in the base model's dtype (bf16 GEMMs on a bf16 model; the optimizer steps
fp32 master copies of them, prmppo/optim.py).
Both start equal to the base: LoRA's B matrices are zero at init (initialised from a seeded
generator), so the first rollout's ratio to the reference is exactly 1.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

from prmppo.config.schema import LoraAdapterConfig
from prmppo.models.compiled_checkpoint import CheckpointOutsideGraph
from prmppo.models.token_scores import token_scores
from prmppo.models.value_head import ValueHead
from prmppo.rollout.compiled_decode import decoder_layers

POLICY_ADAPTER = "policy"


@contextmanager
def adapters_off(model: nn.Module):
    """Run `model` as its base: every peft adapter layer injected into it (e.g. a PRM's, added by
    `PeftModel.from_pretrained`, which keeps no handle here) switched off. Restores each layer's
    on/off state and every parameter's requires_grad flag afterwards (peft's `enable_adapters`
    marks the active adapter trainable again). A model without adapter layers runs unchanged. The reference
    passes use it: peft's `disable_adapter` costs 2.6x its host time (benchmarks/adapter_toggle_bench.py)."""
    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    was_off = [layer.disable_adapters for layer in layers]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer, off in zip(layers, was_off):
            layer.enable_adapters(not off)
        for p, flag in flags:
            p.requires_grad_(flag)


def _value_head(base_model: nn.Module, detach_hidden: bool, critic: bool) -> "ValueHead | None":
    """The critic, on the base model's device; None when the advantage estimator uses no critic."""
    if not critic:
        return None
    return ValueHead(base_model.config.hidden_size, detach_hidden).to(next(base_model.parameters()).device)


class TokenScores(NamedTuple):
    """What one forward gives the PPO loop for a batch of `[prompt (P) | response (T)]` rows."""

    logprobs: torch.Tensor  # [b, T] log pi(response token t | prefix), tempered; 0 off the response mask
    entropy: torch.Tensor | None  # [b, T] entropy of that distribution (when asked for), 0 off the mask
    values: torch.Tensor | None  # [b, P + T] value after each position (None without a critic)


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM under any peft wrapper, refused when its logits are not plain
    `lm_head(final hidden state)` (the chunked logprobs call the head on hidden states directly)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(lm.config, key, None) not in (None, 1, 1.0):
            raise ValueError(f"{lm.config.model_type} applies {key}={getattr(lm.config, key)} to its logits; "
                             f"prmppo's chunked logprobs support plain lm_head logits (Llama, Mistral, Qwen2)")
    return lm


def _inputs_require_grad_in_grad_mode(module: nn.Module, inputs, output: torch.Tensor) -> None:
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


def decoder_mask(lm: nn.Module, attention_mask: torch.Tensor) -> torch.Tensor:
    """The attention mask to hand `lm` (a transformers causal LM, or a peft model on one) for rows with padding mask
    `attention_mask` [b, L] (1 = token). Uncompiled layers get it as it is. Compiled decoder layers under
    SDPA get the [b, 1, L, L] boolean mask transformers would build from it (key k visible to query q
    when k <= q and k is a token), built here for every micro-batch: transformers passes the layers
    None instead when no row has padding, which is a second graph that compiles whenever the first
    micro-batch without padding arrives, mid-run, and it learns that by reading the mask on the host.
    Where a sliding window would cut in (L above it), the mask is left to transformers."""
    lm = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    layers = decoder_layers(lm)
    if layers is None or getattr(layers[0], "_compiled_call_impl", None) is None:  # set by nn.Module.compile
        return attention_mask
    length, window = attention_mask.shape[1], getattr(lm.config, "sliding_window", None)
    if lm.config._attn_implementation != "sdpa" or (window is not None and length > window):
        return attention_mask
    position = torch.arange(length, device=attention_mask.device)
    causal = position[None, :] <= position[:, None]  # [L, L] query x key
    return causal[None, None] & attention_mask.bool()[:, None, None, :]  # [b, 1, L, L]


def _score(lm: nn.Module, value_head, input_ids, attention_mask, position_ids, response_ids, response_mask,
           prompt_length: int, temperature: float, chunk_tokens: int, with_entropy: bool,
           entropy_grad: bool = True, positions: torch.Tensor | None = None) -> TokenScores:
    """One pass of the decoder, then the LM head on the response positions a chunk at a time."""
    hidden = lm.get_decoder()(input_ids=input_ids, attention_mask=decoder_mask(lm, attention_mask),
                              position_ids=position_ids, use_cache=False).last_hidden_state  # [b, P + T, H] normed
    width = response_ids.shape[1]
    # the hidden state that predicts response token t sits at position P - 1 + t
    logprobs, entropy = token_scores(lm.get_output_embeddings(), hidden[:, prompt_length - 1:prompt_length - 1 + width],
                                     response_ids, response_mask, temperature, chunk_tokens, with_entropy,
                                     entropy_grad, positions)
    return TokenScores(logprobs, entropy, None if value_head is None else value_head(hidden))


def call_directly(root: nn.Module, run):
    """How a scoring pass over `root`'s decoder and LM head runs on one process: `run()`."""
    return run()


class _PolicyBase:
    model: nn.Module
    value_head: "ValueHead | None"  # None when the advantage estimator uses no critic (critic=False)
    _checkpointed_layers: tuple[nn.Module, ...] = ()  # set by enable_gradient_checkpointing
    _input_grad_hook = None  # see _first_layer_input_like_the_others
    # `score` calls the decoder and the LM head itself, not the root model's forward; an FSDP2-sharded
    # policy replaces this with `root_forward.as_root_forward`, which runs the pass as the root's forward
    scoring_call = staticmethod(call_directly)

    def score(self, input_ids, attention_mask, position_ids, response_ids, response_mask, prompt_length: int,
              temperature: float, chunk_tokens: int, with_entropy: bool = False,
              entropy_grad: bool = True, positions: torch.Tensor | None = None) -> TokenScores:
        """The policy's logprobs (entropies: with a gradient when `entropy_grad`) of the response tokens
        and its values, without full logits (`positions`: as `token_scores` takes them)."""
        return self.scoring_call(self.model, lambda: _score(
            _causal_lm(self.model), self.value_head, input_ids, attention_mask, position_ids, response_ids,
            response_mask, prompt_length, temperature, chunk_tokens, with_entropy, entropy_grad, positions))

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each decoder layer's activations in backward (transformers' own checkpointing,
        non-reentrant). The update runs in eval mode (dropout off), and transformers checkpoints only
        layers in training mode, so `train` marks the decoder layers themselves as training: their
        submodules (dropout, attention) keep the mode they were given."""
        lm = _causal_lm(self.model)
        if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # transformers marks the embeddings' output as requiring grad, for the reentrant checkpointing this
        # does not use, and does so under no_grad too: a compiled first layer would see an input unlike the
        # later layers' in every no-grad pass (a graph of its own)
        lm.disable_input_require_grads()
        self._first_layer_input_like_the_others()
        self._checkpointed_layers = tuple(m for m in lm.modules() if getattr(m, "gradient_checkpointing", False))
        if not self._checkpointed_layers:
            raise ValueError(f"ppo.gradient_checkpointing: {type(lm).__name__} has no layer transformers can "
                             f"checkpoint")
        self._checkpoint_outside_compiled_graphs()

    def compile_decoder_layers(self) -> None:
        """`torch.compile` each decoder layer of the policy in place (`nn.Module.compile`: parameter
        names, state dicts and the saved checkpoints are unchanged), with dynamic shapes from the first
        call: micro-batch rows and widths vary, and one graph per grad mode serves them all, so a
        micro-batch runs the same kernels in the old-logprob pass as in the update. Two specialisations
        remain: inductor's alignment check guards the graph on the width being a multiple of 8 (the
        trainer feeds only such widths: `ppo/batch.py COMPILED_WIDTH_MULTIPLE`), and a micro-batch of one
        row compiles a graph of its own (dynamo specialises sizes 0 and 1)."""
        layers = decoder_layers(_causal_lm(self.model))
        if layers is None:
            raise ValueError(f"ppo.compile: {type(_causal_lm(self.model)).__name__}'s decoder has no `layers` list "
                             f"to compile (Llama, Mistral and Qwen2 have one); set ppo.compile=false")
        self._first_layer_input_like_the_others()
        # the layers' float constants (norm epsilons, LoRA and attention scalings) as constants: dynamo would
        # otherwise trace them as symbolic floats, fail to turn them into tensors, and trace every graph twice
        # (a restart of its analysis: seconds per graph on a GPU, warm cache or not). Process-wide: these
        # layers are all this process compiles
        torch._dynamo.config.specialize_float = True
        for layer in layers:
            layer.compile(dynamic=True)
        self._checkpoint_outside_compiled_graphs()

    def _checkpoint_outside_compiled_graphs(self) -> None:
        """Compiled and checkpointed decoder layers checkpoint around their compiled forward rather than
        inside it (`CheckpointOutsideGraph`). Runs after whichever of `enable_gradient_checkpointing` and
        `compile_decoder_layers` comes second; once."""
        layers = [layer for layer in self._checkpointed_layers
                  if getattr(layer, "_compiled_call_impl", None) is not None
                  and not isinstance(getattr(layer, "_gradient_checkpointing_func", None), CheckpointOutsideGraph)]
        shared: dict = {}  # one compiled forward per layer class, for every layer
        for layer in layers:
            layer._gradient_checkpointing_func = CheckpointOutsideGraph(layer._gradient_checkpointing_func, shared)

    def _first_layer_input_like_the_others(self) -> None:
        """In grad mode, the embeddings' output requires grad, as every later layer's input does (under LoRA
        the embeddings are frozen): one graph of a compiled layer then serves all the layers."""
        if self._input_grad_hook is None:
            self._input_grad_hook = _causal_lm(self.model).get_input_embeddings().register_forward_hook(
                _inputs_require_grad_in_grad_mode)

    def forward(self, input_ids, attention_mask, position_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy logits [B, L, V] and values [B, L]."""
        out = self.model(input_ids=input_ids, attention_mask=decoder_mask(self.model, attention_mask),
                         position_ids=position_ids, output_hidden_states=True, use_cache=False)
        values = None if self.value_head is None else self.value_head(out.hidden_states[-1])
        return out.logits, values

    def value_parameters(self) -> list[nn.Parameter]:
        return [] if self.value_head is None else list(self.value_head.parameters())

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)
        for layer in self._checkpointed_layers:
            layer.training = True  # the layer flag only: checkpointing stays on with dropout off
        if self.value_head is not None:
            self.value_head.train(mode)


class LoraPolicy(_PolicyBase):
    """`policy` LoRA adapter on the resident base; reference = base with adapters off."""

    # what `rollout.sync=adapter` needs (checked from the class when the config is validated)
    ships_adapter = True

    def __init__(
        self,
        base_model: nn.Module,
        detach_value_hidden: bool,
        critic: bool,
        r: int = LoraAdapterConfig.r,
        alpha: int = LoraAdapterConfig.alpha,
        dropout: float = LoraAdapterConfig.dropout,
        target_modules: list[str] | None = None,
        init_seed: int = LoraAdapterConfig.init_seed,
        modules_to_save: list[str] | None = None,
        modules_to_save_lr: float | None = LoraAdapterConfig.modules_to_save_lr,
    ):
        # None: the schema's lists
        target_modules = list(LoraAdapterConfig().target_modules if target_modules is None else target_modules)
        modules_to_save = list(LoraAdapterConfig().modules_to_save if modules_to_save is None else modules_to_save)
        names = [name for name, _ in base_model.named_modules()]
        for wanted in modules_to_save:  # peft would skip a name that matches nothing, silently
            if not any(name == wanted or name.endswith(f".{wanted}") for name in names):
                raise ValueError(f"lora.modules_to_save: no module of the base model is named {wanted!r} "
                                 f"(e.g. 'model.norm', the final norm)")
            if getattr(base_model.config, "tie_word_embeddings", False) and wanted.split(".")[-1] in (
                    "lm_head", "embed_tokens"):
                raise ValueError(f"lora.modules_to_save: {wanted!r} shares its weight with the tied input/output "
                                 f"embedding; training one copy would break the tie in the synced weights")
        config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                            modules_to_save=modules_to_save or None, bias="none", task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):  # peft draws LoRA A from the global generator
            torch.manual_seed(init_seed)
            # the factors in the base's dtype (peft would upcast a bf16 base's to fp32, and every LoRA layer
            # would then cast its input to fp32 and run fp32 GEMMs, forward and backward): a bf16 model
            # trains them through fp32 master copies (prmppo/optim.py MasterWeights); an fp32 model is unchanged
            self.model = get_peft_model(base_model, config, adapter_name=POLICY_ADAPTER,
                                        autocast_adapter_dtype=False)
        self.modules_to_save_lr = modules_to_save_lr
        self.lora_rank = r  # what an engine serving the adapter must reserve
        self.value_head = _value_head(base_model, detach_value_hidden, critic)

    def policy_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.model.named_parameters() if p.requires_grad and f".{POLICY_ADAPTER}." in name]

    def policy_param_groups(self, lr: float) -> list[dict]:
        """Optimizer groups: the LoRA factors at `lr`, fully trained modules at their own lr."""
        lora, full = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad and f".{POLICY_ADAPTER}." in name:
                (full if f".modules_to_save.{POLICY_ADAPTER}." in name else lora).append(p)
        groups = [{"params": lora, "lr": lr}]
        if full:
            groups.append({"params": full, "lr": lr if self.modules_to_save_lr is None else self.modules_to_save_lr})
        return groups

    @property
    def prm_host(self) -> nn.Module:
        """The model a PRM adapter joins: the resident base the policy adapter lives on."""
        return self.model

    @torch.no_grad()
    def reference_logits(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        with adapters_off(self.model):  # peft's disable_adapter reprs every adapter layer for a status check
            return self.model(input_ids=input_ids, attention_mask=decoder_mask(self.model, attention_mask),
                              position_ids=position_ids, use_cache=False).logits

    @torch.no_grad()
    def reference_score(self, input_ids, attention_mask, position_ids, response_ids, response_mask,
                        prompt_length: int, temperature: float, chunk_tokens: int, positions=None) -> torch.Tensor:
        """Reference logprobs [b, T] of the response tokens (the base: adapters off), without full logits."""
        with adapters_off(self.model):  # peft's disable_adapter reprs every adapter layer for a status check
            return self.scoring_call(self.model, lambda: _score(
                _causal_lm(self.model), None, input_ids, attention_mask, position_ids, response_ids, response_mask,
                prompt_length, temperature, chunk_tokens, False, positions=positions).logprobs)

    @torch.no_grad()
    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """Base weights + the policy adapter's delta, under the base model's own key names.

        Computed beside the base (W + scale * B @ A per adapted layer) rather than with peft's
        in-place merge/unmerge, which would leave float rounding drift in the reference weights.
        """
        base = self.model.get_base_model()
        merged: dict[str, torch.Tensor] = {}
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and POLICY_ADAPTER in module.lora_A:
                weight = module.get_base_layer().weight
                merged[f"{name}.weight"] = weight + module.get_delta_weight(POLICY_ADAPTER).to(weight.dtype)
        trained = f".modules_to_save.{POLICY_ADAPTER}."
        full = {key.replace(trained, "."): value for key, value in base.state_dict().items() if trained in key}
        state = {}
        for key, value in base.state_dict().items():
            if "lora_" in key or ".modules_to_save." in key:
                continue
            clean = key.replace(".base_layer.", ".").replace(".original_module.", ".")
            state[clean] = full.get(clean, merged.get(clean, value))
        return state

    def save_merged(self, out_dir: Path, tokenizer) -> Path:
        base = self.model.get_base_model()
        base.save_pretrained(out_dir, state_dict=self.merged_state_dict())
        tokenizer.save_pretrained(out_dir)
        return out_dir

    def save_adapter(self, out_dir: Path) -> Path:
        self.model.save_pretrained(out_dir, selected_adapters=[POLICY_ADAPTER])
        return out_dir


class FullPolicy(_PolicyBase):
    """Full fine-tuning; a frozen deep copy of the starting model is the reference (adapters off)."""

    ships_adapter = False
    lora_rank = 0

    def __init__(self, base_model: nn.Module, detach_value_hidden: bool, critic: bool):
        self.model = base_model
        self.reference = copy.deepcopy(base_model).eval().requires_grad_(False)
        self.value_head = _value_head(base_model, detach_value_hidden, critic)

    def policy_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def policy_param_groups(self, lr: float) -> list[dict]:
        return [{"params": self.policy_parameters(), "lr": lr}]

    @property
    def prm_host(self) -> nn.Module:
        """The model a PRM adapter joins: the frozen copy (the trained weights keep moving), which
        `reference_score` and `reference_logits` run with that adapter off."""
        return self.reference

    @torch.no_grad()
    def reference_logits(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        # the PRM's LoRA layers sit inside the copy and are on (its active adapter) between scorings;
        # left on, they would make the KL reference base + PRM adapter instead of the SFT base
        with adapters_off(self.reference):
            return self.reference(input_ids=input_ids,
                                  attention_mask=decoder_mask(self.reference, attention_mask),
                                  position_ids=position_ids, use_cache=False).logits

    @torch.no_grad()
    def reference_score(self, input_ids, attention_mask, position_ids, response_ids, response_mask,
                        prompt_length: int, temperature: float, chunk_tokens: int, positions=None) -> torch.Tensor:
        """Reference logprobs [b, T] of the response tokens (the frozen copy, adapters off), without full logits."""
        with adapters_off(self.reference):
            return self.scoring_call(self.reference, lambda: _score(
                _causal_lm(self.reference), None, input_ids, attention_mask, position_ids, response_ids,
                response_mask, prompt_length, temperature, chunk_tokens, False, positions=positions).logprobs)

    @torch.no_grad()
    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's own tensors (no adapter to merge), under its own key names."""
        return dict(self.model.state_dict())

    def save_merged(self, out_dir: Path, tokenizer) -> Path:
        self.model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        return out_dir

    def save_adapter(self, out_dir: Path) -> Path:
        raise ValueError("rollout.sync=adapter needs lora=adapter; lora=none has no adapter to ship")
