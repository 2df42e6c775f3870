"""The built-in engine's fast decode path: a pre-allocated KV cache, CUDA graphs, bucketed rows.

`sample_static` returns exactly what `decoding.sample_loop` returns (tokens [B, T], logprobs
[B, T], done [B]) and draws the same random numbers, so for a fixed seed both paths sample the
same tokens up to float rounding of the logits. What it does differently:

- KV cache: `SlotCache` owns one buffer per layer, [rows, kv_heads, slots, head_dim], allocated
  once and reused across requests (`StaticDecoder` is kept by the engine). Row i's prompt sits
  left-padded in slots [P - len_i, P); the token of decode step t is written to slot P + t for
  every row at once. A bool map `valid` [rows, slots] says which slots a row may attend to; the
  model gets it as a ready 4D additive mask [b, 1, q, slots], which transformers' mask
  builders pass through unchanged.
- Prefill: rows sorted by prompt length, longest first, so the n samples of a prompt are
  neighbours; each distinct prompt runs once and its keys/values are copied to its n slot
  rows. The distinct prompts run in chunks of at most `prefill_tokens` padded tokens, each
  padded only to its own longest prompt, each writing its keys and values into its rows of the
  shared buffers; only the last position's logits are kept.
- Decode: one fixed-shape step per bucket size (the batch, then powers of two below it). On CUDA
  each bucket's step is captured once as a CUDA graph (`torch.cuda.graph`) and replayed, which
  removes the per-kernel launch cost that dominates a small model's decode step; the graphs
  stay valid while the model's parameters keep their storage (in-place weight updates included).
- Finished rows: every `done_check_every` steps the number of unfinished rows is read (the only
  host sync of the loop); when it fits a smaller bucket, the unfinished rows are moved to the
  front of the buffers and decoding continues at that bucket size.
- Attention: decode forwards run `grouped_attention.py` (registered with transformers and set
  only around those forwards), which never expands K/V from the KV heads to the query heads
  as transformers' sdpa/eager do under a 4D mask. Prefill keeps the model's own attention:
  for q > 1 grouped attention copies the chunk's mask out to every query head of a group
  ([b, 1, g*q, S]), and prefill's K/V copy (its chunk's rows) happens once per request.
  Models with softcapping or sinks keep their own attention for decode too (with a warning).
- `compile_decode` (`rollout.compile_decode`): in decode steps of 2 rows or more every decoder layer
  runs one compiled graph of a layer, shared by all layers, buckets and cache lengths
  (`compiled_decode.py`); prefill and the bucket of one row stay eager.
- Sampling happens outside the graph, on the device: the exponential noise for the whole batch
  is drawn every step and indexed by each slot's row, so which rows share a bucket never
  changes what a row samples.

Requirements, checked by `unsupported_reason` (the engine falls back to the dynamic-cache loop
when one fails): a transformers causal LM that accepts a 4D attention mask, sdpa or eager
attention, and no sliding window shorter than the cache (the 4D mask has no window).
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch

from prmppo.rollout import compiled_decode, grouped_attention

LOG = logging.getLogger(__name__)


class SlotCache:
    """The KV cache object handed to the model: writes each layer's new keys/values at `slots`.

    `keys[l]` and `values[l]` are [rows, kv_heads, slots_total, head_dim] views of the decoder's
    buffers; `slots` [q] holds the slot of each of the q new positions. Duck-typed to the part of
    transformers' `Cache` that attention layers call (`update`).
    """

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor,
                 seq_length: int) -> None:
        self.keys, self.values, self.slots, self.seq_length = keys, values, slots, seq_length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.slots, key_states.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, self.slots, value_states.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_length

    def __len__(self) -> int:
        return len(self.keys)


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _cache_kwarg(model) -> str | None:
    """The name under which this transformers' forward takes the KV cache, or None."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    return None


def unsupported_reason(model, slots_total: int) -> str | None:
    """Why `StaticDecoder` cannot run `model` with a cache of `slots_total` slots; None when it can."""
    config = _text_config(model)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager"):
        return f"attention implementation {attention!r} (the static path needs sdpa or eager)"
    if _cache_kwarg(model) is None:
        return f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not layer_types <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(layer_types)}"
    # the 4D mask has no window: refuse a window the cache could outgrow (Qwen2 names it off explicitly)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) and window is not None and window < slots_total:
        return f"sliding window {window} < {slots_total} cache slots"
    return None


def bucket_sizes(rows: int) -> list[int]:
    """Decode batch sizes, largest first: `rows`, then the powers of two below it."""
    sizes, size = [rows], 1
    while size < rows:
        sizes.append(size)
        size *= 2
    return sorted(set(sizes), reverse=True)


def prefill_chunks(lengths: list[int], prefill_tokens: int) -> list[tuple[int, int]]:
    """Split rows sorted by length (longest first) into [start, stop) chunks of <= prefill_tokens
    padded tokens (one row always fits); each chunk pads to its first (longest) row."""
    chunks, start = [], 0
    for index in range(1, len(lengths)):
        if (index - start + 1) * lengths[start] > prefill_tokens:
            chunks.append((start, index))
            start = index
    chunks.append((start, len(lengths)))
    return chunks


def _decode_attention(model) -> str | None:
    """The attention implementation for decode forwards: grouped attention, or None (the model's own)."""
    reason = grouped_attention.refusal(model) or grouped_attention.register()
    if reason is None:
        return grouped_attention.NAME
    LOG.warning("decode keeps %s attention, which expands K/V to every query head: grouped attention "
                "cannot run this model (%s)", _text_config(model)._attn_implementation, reason)
    return None


def weights_key(model) -> tuple[int, ...]:
    """The storage of every parameter: captured graphs read these addresses, so a change voids them."""
    return tuple(parameter.data_ptr() for parameter in model.parameters())


def forward_rows(model, cache_kwarg: str, keeps_logits: bool, cache: SlotCache, input_ids, positions,
                 keep) -> torch.Tensor:
    """One forward of `model` over the rows whose KV buffers `cache` holds, writing the new positions' keys and
    values at its slots; input_ids and positions [b, q], keep [b, q, S] bool (the slots each query may attend
    to) -> the last position's logits [b, V]."""
    dtype = cache.keys[0].dtype
    additive = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    additive = additive.masked_fill(~keep, torch.finfo(dtype).min)[:, None]  # [b, 1, q, S]
    extra = {"logits_to_keep": 1} if keeps_logits else {}
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, attention_mask=additive,
                **{cache_kwarg: cache}, **extra)
    return out.logits[:, -1, :]


class StaticDecoder:
    """KV buffers for `rows` rows x `slots_total` slots and one decode step per bucket size.

    Built for one model and one batch size; the engine keeps it across requests while `fits`.
    With `use_graphs` (CUDA only) each bucket's step is captured as a CUDA graph on first use.
    """

    def __init__(self, model, rows: int, slots_total: int, use_graphs: bool, prefill_tokens: int,
                 compile_decode: bool = False) -> None:
        config = _text_config(model)
        first = next(model.parameters())
        self.model, self.rows, self.slots_total = model, rows, slots_total
        self.device, self.dtype = first.device, first.dtype
        self.use_graphs, self.prefill_tokens, self.compile_decode = use_graphs, prefill_tokens, compile_decode
        self.layers = compiled_decode.decoder_layers(model) if compile_decode else None
        if compile_decode and self.layers is None:
            raise ValueError(f"rollout.compile_decode: {type(model).__name__} has no decoder `layers` list to compile "
                             f"(Llama, Mistral and Qwen2 have one); set rollout.compile_decode=false")
        # the compiled step's stacked q/k/v and gate/up weights (`compiled_decode.FusedProjections`), refreshed
        # at each request's prefill
        self.fused = (compiled_decode.FusedProjections(self.layers)
                      if compile_decode and compiled_decode.FUSE_PROJECTIONS else None)
        self.fusion_refusal: str | None = None  # why the last request's step could not run fused
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (rows, kv_heads, slots_total, head_dim)  # [R, H_kv, S, D]
        # zeros, not empty: a masked slot still enters q.k, and uninitialised memory may hold NaN
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                     for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros_like(buffer) for buffer in self.keys]
        self.valid = torch.zeros((rows, slots_total), dtype=torch.bool, device=self.device)  # [R, S]
        self.input_ids = torch.zeros((rows, 1), dtype=torch.long, device=self.device)  # [R, 1]
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=self.device)  # [R, 1]
        self.write_slot = torch.zeros(1, dtype=torch.long, device=self.device)  # [1]
        self.seq_length = 0  # host copy of write_slot, for SlotCache.get_seq_length
        self.cache_kwarg = _cache_kwarg(model)
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.graphs: dict[int, tuple] = {}  # bucket -> (CUDAGraph, its logits output [bucket, V])
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.weights_key = weights_key(model)
        self.decode_attention = _decode_attention(model)  # an AttentionInterface name, or None

    def fits(self, model, rows: int, slots_total: int) -> bool:
        """Whether this decoder can serve `rows` x `slots_total` for `model` as it is now."""
        return (self.model is model and self.rows == rows and slots_total <= self.slots_total
                and self.weights_key == weights_key(model))

    def _forward(self, input_ids, positions, keep, rows: slice, slots, compiled: bool = False) -> torch.Tensor:
        """One forward over rows `rows` writing at `slots`; keep [b, q, S] bool -> logits [b, V]. `compiled`:
        the decoder layers run the compiled layer step (`compiled_decode.py`)."""
        keys, values = [k[rows] for k in self.keys], [v[rows] for v in self.values]
        cache = SlotCache(keys, values, slots, self.seq_length)
        fused = self.fused.weights if self.fused is not None else None
        layers = (compiled_decode.layer_calls(self.layers, keys, values, slots, cache, fused) if compiled
                  else contextlib.nullcontext())
        with layers:
            return forward_rows(self.model, self.cache_kwarg, self.keeps_logits, cache, input_ids, positions, keep)

    def prefill(self, rows: list[list[int]], pad_token_id: int) -> torch.Tensor:
        """Write the prompts `rows` (sorted longest first) into slots [P - len, P); logits [B, V].

        Equal neighbouring rows (the samples of one prompt) are run once: the distinct prompts
        are prefilled into the first slot rows, then their keys, values and logits are copied
        out to every row that repeats them.
        """
        if self.fused is not None:  # a request: the weights as they are now (a kept decoder's may have changed)
            version = self.fused.version
            reason = self.fused.refresh()
            if self.fused.version != version:
                self.graphs.clear()  # captured with the stacked weights' old tensors
            if reason is not None and reason != self.fusion_refusal:
                LOG.info("compiled decode step: the layers' own forward, not fused projections (%s)", reason)
            self.fusion_refusal = reason
        count, prompt_slots = len(rows), len(rows[0])
        source = [0]  # [B]: the distinct prompt each row repeats
        for index in range(1, count):
            source.append(source[-1] + (rows[index] != rows[index - 1]))
        distinct = [row for index, row in enumerate(rows) if index == 0 or row != rows[index - 1]]
        logits = self._prefill_distinct(distinct, pad_token_id)  # [U, V]
        if len(distinct) < count:
            source = torch.tensor(source, device=self.device)  # [B]
            for buffer in (*self.keys, *self.values):
                buffer[:count, :, :prompt_slots] = buffer[:, :, :prompt_slots].index_select(0, source)
            self.valid[:count] = self.valid.index_select(0, source)
            logits = logits.index_select(0, source)  # [B, V]
        lengths = torch.tensor([len(row) for row in rows], device=self.device)
        self.positions[:count, 0] = lengths
        self.write_slot.fill_(prompt_slots)
        self.seq_length = prompt_slots
        return logits

    def _prefill_distinct(self, rows: list[list[int]], pad_token_id: int) -> torch.Tensor:
        """Prefill `rows` (sorted longest first) into slot rows [0, len(rows)) in length-sorted
        chunks; returns the logits at each row's last position [U, V]."""
        from prmppo.rollout.sampling import left_pad  # sampling imports nothing from here

        prompt_slots = len(rows[0])
        self.valid[:len(rows)].zero_()
        slot_range = torch.arange(self.slots_total, device=self.device)  # [S]
        logits = []
        for start, stop in prefill_chunks([len(row) for row in rows], self.prefill_tokens):
            input_ids, attention_mask, positions = left_pad(rows[start:stop], pad_token_id, self.device)
            width = input_ids.shape[1]
            slots = slot_range[prompt_slots - width:prompt_slots]  # [p]
            self.valid[start:stop, prompt_slots - width:prompt_slots] = attention_mask.bool()
            # a query sees the valid slots up to its own, and itself (a pad must not get an empty row)
            causal = slot_range[None, :] <= slots[:, None]  # [p, S]
            keep = (self.valid[start:stop, None, :] & causal) | (slot_range == slots[:, None])  # [b, p, S]
            self.seq_length = prompt_slots - width
            logits.append(self._forward(input_ids, positions, keep, slice(start, stop), slots))
        return torch.cat(logits)  # [U, V]

    def step(self, tokens: torch.Tensor, bucket: int) -> torch.Tensor:
        """Feed tokens [bucket] (one per slot row) at the next slot; returns logits [bucket, V].

        The logits may be a graph's output buffer: read them before the next `step`.
        """
        self.input_ids[:bucket, 0] = tokens
        self.valid[:bucket].index_fill_(1, self.write_slot, True)
        logits = self._replay(bucket) if self.use_graphs else self._decode_forward(bucket)
        self.positions[:bucket] += 1
        self.write_slot += 1
        self.seq_length += 1
        return logits

    def compact(self, keep_rows: torch.Tensor) -> None:
        """Move rows `keep_rows` [b] (indices into the current bucket) to the front, in that order."""
        count = len(keep_rows)
        for buffer in (*self.keys, *self.values, self.valid, self.positions):
            buffer[:count] = buffer.index_select(0, keep_rows)

    def _decode_forward(self, bucket: int) -> torch.Tensor:
        keep = self.valid[:bucket, None, :]  # [b, 1, S]
        # size 1 would be a graph of its own (dynamo specialises it): that bucket stays eager
        compiled = self.compile_decode and bucket > 1
        with grouped_attention.attention_implementation(self.model, self.decode_attention):
            return self._forward(self.input_ids[:bucket], self.positions[:bucket], keep, slice(0, bucket),
                                 self.write_slot, compiled)

    def _replay(self, bucket: int) -> torch.Tensor:
        if bucket not in self.graphs:
            try:
                self.graphs[bucket] = self._capture(bucket)
            except RuntimeError as err:  # e.g. an op that syncs with the host inside the model
                LOG.warning("CUDA graph capture of the decode step failed (%s); decoding without graphs",
                            str(err).splitlines()[0] if str(err) else type(err).__name__)
                self.use_graphs = False
                return self._decode_forward(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits

    def _capture(self, bucket: int) -> tuple:
        """Capture bucket's decode step. The warm-up runs are the real step (same inputs, same slot
        written), so running them here changes nothing the replay would not."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisations (cuBLAS workspaces, kernel choices) happen here
                self._decode_forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._decode_forward(bucket)
        return graph, logits


def sample_static(decoder: StaticDecoder, rows: list[list[int]], max_new_tokens: int, temperature: float,
                  top_p: float, generator: torch.Generator, eos_token_id: int, pad_token_id: int,
                  done_check_every: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill + bucketed static decode; returns tokens [B, T], logprobs [B, T], done [B] (T <= max)."""
    from prmppo.rollout.sampling import next_tokens

    count, device = len(rows), decoder.device
    order = sorted(range(count), key=lambda row: -len(rows[row]))  # longest first; ties keep their order
    logits = decoder.prefill([rows[row] for row in order], pad_token_id)  # [B, V], slot order
    row_of_slot = torch.tensor(order, device=device)  # [b]: the row each slot decodes
    tokens = torch.full((count, max_new_tokens), pad_token_id, dtype=torch.long, device=device)  # [B, T]
    logprobs = torch.zeros((count, max_new_tokens), dtype=torch.float32, device=device)  # [B, T]
    done = torch.zeros(count, dtype=torch.bool, device=device)  # [B]
    buckets, bucket = bucket_sizes(count), count
    for step in range(max_new_tokens):
        new, new_logprobs = next_tokens(logits, temperature, top_p, generator, row_of_slot, count)  # [b], [b]
        slot_done = done[row_of_slot]  # [b]
        new = new.masked_fill(slot_done, pad_token_id)  # finished rows emit nothing real
        tokens[row_of_slot, step] = new
        logprobs[row_of_slot, step] = new_logprobs
        done[row_of_slot] = slot_done | (new == eos_token_id)
        if step == max_new_tokens - 1:
            break
        if (step + 1) % done_check_every == 0:
            remaining = int((~done).sum())  # the loop's only host sync
            if remaining == 0:
                break
            smaller = min(size for size in buckets if size >= remaining)
            if smaller < bucket:  # unfinished slots first, then enough finished ones to fill the bucket
                keep = torch.argsort(done[row_of_slot].to(torch.uint8), stable=True)[:smaller]
                decoder.compact(keep)
                row_of_slot, new, bucket = row_of_slot[keep], new[keep], smaller
        logits = decoder.step(new, bucket)
    return tokens[:, :step + 1], logprobs[:, :step + 1], done
