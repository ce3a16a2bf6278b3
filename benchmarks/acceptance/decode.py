"""Greedy speculative decoding with a speculators drafter (EAGLE-3 or DFlash) against a Hugging Face target, and the
target's plain greedy decoding it must reproduce token for token.

Shares no code with the extraction: the target's features the drafter reads are taken here, from the target's own
forward pass inside the loop, the way vLLM takes them when serving: layer id k = the input of decoder layer k
(Hugging Face's ``hidden_states[k]``; k = L, the number of layers, is the last layer's output before the final
norm), for the ids in the drafter's config (EAGLE-3 ``eagle_aux_hidden_state_layer_ids``, DFlash
``aux_hidden_state_layer_ids``: speculators numbers both alike; its DFlash converter adds 1 to z-lab's ids). A
convention error in the data the drafter was trained on therefore shows here as lost acceptance.

One verification step: the target's cache holds positions 0..n-1 and x(n), the token it chose last, is pending;
the drafter proposes d1..dk, the target runs [x(n), d1..dk] in one forward pass (its argmax p0..pk), the longest
prefix with d(j+1) = p(j) is accepted (a tokens) and p(a), the target's own next token, is emitted after it; the
cache is cropped to n + a + 1 positions. tau counts a + 1 per step, as vLLM's mean acceptance length does; the
tokens past the stop (EOS or the token budget) are then cut from the output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import DynamicCache


class TargetFeatures:
    """The target with hooks that record, on every forward pass, the inputs of the decoder layers in ``layer_ids``
    (an id equal to the layer count: the last layer's output, before the final norm), concatenated in that order.
    ``offset`` shifts every id (a deliberate convention error, for the experiments that measure one)."""

    def __init__(self, model: Any, layer_ids: list[int], offset: int = 0):
        self.model = model
        layers = model.model.layers
        kinds = set(getattr(model.config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
        if kinds:  # a recurrent state (linear attention, Mamba) cannot be cut back to the accepted tokens
            raise ValueError(f"the target has {sorted(kinds)} layers: the loop needs a target whose cache crops")
        self.ids = [k + offset for k in layer_ids]
        bad = [k for k in self.ids if not 0 <= k <= len(layers)]
        if bad:
            raise ValueError(
                f"feature layer ids {bad} are outside 0..{len(layers)} for this {len(layers)}-layer target"
            )
        self.captured: dict[int, torch.Tensor] = {}
        for k in set(self.ids):
            if k < len(layers):
                layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True)
            else:
                layers[k - 1].register_forward_hook(self._post_hook(k))

    def _pre_hook(self, k: int):
        def hook(module, args, kwargs):
            self.captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _post_hook(self, k: int):
        def hook(module, args, output):
            self.captured[k] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def forward(self, ids: list[int], cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [len(ids), V], features [len(ids), len(layer_ids) * H]) of ``ids`` after the cached positions."""
        self.captured.clear()
        out = self.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        if not self.ids:  # a drafter that reads no features (the oracle)
            return out.logits[0].float(), torch.empty(len(ids), 0)
        features = torch.cat([self.captured[k][0] for k in self.ids], dim=-1)
        return out.logits[0].float(), features.float()


def keep(cache: DynamicCache, length: int) -> None:
    """Cut ``cache`` to its first ``length`` positions (transformers deprecates crop's positive argument)."""
    surplus = cache.get_seq_length() - length
    if surplus > 0:
        cache.crop(-surplus)


@dataclass
class Decode:
    """One prompt's speculative decoding: the emitted tokens and what each verification step accepted."""

    tokens: list[int]
    accepted: list[int]  # per verification step: drafted tokens the target accepted (tau counts each + 1)
    k: int
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def tau(self) -> float | None:
        """None when the prefill's token already ended the decode (no verification step)."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else None


@dataclass
class Greedy:
    """The target's plain greedy decoding, one token per forward pass, and its top-2 logit margin at each token
    (how close a tie was, for reporting a numerical flip)."""

    tokens: list[int]
    margins: list[float] = field(default_factory=list)
    forward_seconds: list[float] = field(default_factory=list)  # the decoding forwards (the prefill left out)
    seconds: float = 0.0  # the whole decode, prefill included, as a speculative decode is timed


def _stop(tokens: list[int], budget: int, eos: set[int]) -> list[int]:
    """``tokens`` cut after the first EOS and to ``budget``."""
    for i, token in enumerate(tokens[:budget]):
        if token in eos:
            return tokens[: i + 1]
    return tokens[:budget]


@torch.no_grad()
def greedy(model: Any, prompt: list[int], budget: int, eos: set[int]) -> Greedy:
    started = time.perf_counter()
    cache = DynamicCache()
    result = Greedy(tokens=[])
    ids = prompt
    while len(result.tokens) < budget:
        forward_started = time.perf_counter()
        logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1].float()
        if len(result.tokens) > 0:  # the prefill is not a decoding step
            result.forward_seconds.append(time.perf_counter() - forward_started)
        top = torch.topk(logits, 2)
        token = int(logits.argmax())  # as the speculative loop picks, should two logits be exactly equal
        result.tokens.append(token)
        result.margins.append(float(top.values[0] - top.values[1]))
        if token in eos:
            break
        ids = [token]
    result.seconds = time.perf_counter() - started
    return result


def speculative(target: TargetFeatures, proposer, prompt: list[int], k: int, budget: int, eos: set[int]) -> Decode:
    """Greedy speculative decoding of ``prompt`` with ``k`` drafted tokens per verification step."""
    started = time.perf_counter()
    cache = DynamicCache()
    logits, features = target.forward(prompt, cache)
    tokens = [*prompt, int(logits[-1].argmax())]  # the prefill's token: no draft, no step
    result = Decode(tokens=[], accepted=[], k=k)
    proposer.start()
    while len(tokens) - len(prompt) < budget and tokens[-1] not in eos:
        draft_started = time.perf_counter()
        drafts = proposer.propose(tokens, features, k)
        verify_started = time.perf_counter()
        logits, new_features = target.forward([tokens[-1], *drafts], cache)
        predicted = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
            accepted += 1
        keep(cache, len(tokens) + accepted)  # x(n) and the accepted drafts stay; the rejected go
        features = torch.cat([features, new_features[: accepted + 1]])
        tokens += [*drafts[:accepted], predicted[accepted]]
        result.accepted.append(accepted)
        result.draft_seconds += verify_started - draft_started
        result.verify_seconds += time.perf_counter() - verify_started
    result.tokens = _stop(tokens[len(prompt) :], budget, eos)
    result.seconds = time.perf_counter() - started
    return result


def first_difference(decoded: list[int], reference: list[int]) -> int | None:
    """The first position where the two differ (a length difference counts), or None when they are equal."""
    for i, (a, b) in enumerate(zip(decoded, reference)):
        if a != b:
            return i
    return None if len(decoded) == len(reference) else min(len(decoded), len(reference))


class Eagle3Proposer:
    """speculators' EAGLE-3 drafter chained as its serving implementation drafts: the first step reads the target's
    features of every position not yet seen (position i pairs the features of i with token i + 1, positions counted
    from 1 as in its training), each later step the drafter's own token and its own hidden state (post-norm when
    ``norm_output``). The drafter's cache keeps the positions the target confirmed; the chain is cropped off."""

    def __init__(self, drafter: Any):
        self.drafter = drafter.float().eval()
        config = drafter.config.transformer_layer_config
        if getattr(config, "layer_types", None) and "sliding_attention" in config.layer_types:
            self.window = getattr(config, "sliding_window", None)
        else:
            self.window = None

    @property
    def layer_ids(self) -> list[int]:
        return list(self.drafter.config.eagle_aux_hidden_state_layer_ids)

    def start(self) -> None:
        self.cache = DynamicCache()
        self.seen = 0  # drafter positions in the cache (feature i with token i + 1, for i < seen)

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        d2t = self.drafter.d2t
        return draft_ids + d2t[draft_ids] if self.drafter.use_draft_vocab else draft_ids

    def _layers(self, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        past = self.cache.get_seq_length()
        length = inputs.shape[1]
        if self.window is not None and past + length > self.window:
            raise ValueError(f"sequence longer than the drafter's {self.window}-token sliding window")
        mask = torch.full((length, past + length), float("-inf")).triu(past + 1)[None, None]
        embeddings = self.drafter.rotary_emb(inputs, positions)
        hidden = inputs
        for layer in self.drafter.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                           cache_position=positions[0] - 1, position_embeddings=embeddings)  # fmt: skip
        return hidden

    def _head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden state fed to the next step, the next token in the target's vocabulary)."""
        if self.drafter.config.norm_output:
            hidden = self.drafter.norm(hidden)
            logits = self.drafter.lm_head(hidden)
        else:
            logits = self.drafter.lm_head(self.drafter.norm(hidden))
        return hidden, self._to_target(logits[:, -1].argmax(-1))

    @torch.no_grad()
    def propose(self, tokens: list[int], features: torch.Tensor, k: int) -> list[int]:
        d = self.drafter
        keep(self.cache, self.seen)
        n = len(tokens) - 1  # features exist for positions 0..n-1; token n is the target's latest
        states = features[self.seen : n][None]
        if d.input_norm is not None:
            states = d.input_norm(states)
        if d.fc_norm is not None:
            states = torch.cat([norm(c) for norm, c in zip(d.fc_norm, states.chunk(len(d.fc_norm), dim=-1))], -1)
        states = d.fc(states)
        ids = torch.tensor([tokens[self.seen + 1 : n + 1]])
        positions = torch.arange(self.seen + 1, n + 1)[None]
        hidden, token = self._head(self._layers(torch.cat([d.embed_tokens(ids), states], -1), positions))
        self.seen = n
        drafts = [int(token)]
        for step in range(1, k):
            inputs = torch.cat([d.embed_tokens(token[None]), hidden[:, -1:]], -1)
            hidden, token = self._head(self._layers(inputs, torch.tensor([[n + step]])))
            drafts.append(int(token))
        return drafts

    @torch.no_grad()
    def speculators_forward(self, tokens: list[int], features: torch.Tensor, k: int) -> list[int]:
        """What speculators' own (training) forward drafts after ``tokens`` when its teacher-forced inputs are this
        chain's own drafts: the chain above must give the same tokens (``measure --check-forward``)."""
        n = len(tokens) - 1
        drafts = self.propose(tokens, features, k)
        sequence = tokens + drafts
        length = len(sequence) - 1  # pairs (features of i, token i + 1); features past n - 1 are never attended
        states = torch.cat([features[:n], torch.zeros(length - n, features.shape[1])])[None]
        steps = self.drafter(hidden_states=states, input_ids=torch.tensor([sequence[1:]]),
                             document_ids=torch.zeros(1, length, dtype=torch.long),
                             position_ids=torch.arange(1, length + 1)[None], ttt_steps=k)  # fmt: skip
        return [int(self._to_target(step[0, n - 1])) for step in steps]


class DFlashProposer:
    """speculators' DFlash drafter: one pass drafts a block. The block is the target's latest token (the anchor)
    followed by mask tokens, at the positions after the context; it attends to the whole block and to the target's
    features of every earlier position (projected by ``fc`` and ``hidden_norm``), whose keys and values the drafter
    caches; slot j of the block proposes the token j after the anchor."""

    def __init__(self, drafter: Any):
        self.drafter = drafter.float().eval()
        self.block_size = drafter.config.block_size
        config = drafter.config.transformer_layer_config
        if getattr(config, "layer_types", None) and "sliding_attention" in config.layer_types:
            raise ValueError("this loop drafts with full-attention DFlash layers only; the checkpoint has sliding ones")
        if drafter.config.sample_from_anchor:
            raise ValueError("sample_from_anchor DFlash drafters (the anchor slot drafts too) are not supported")

    @property
    def layer_ids(self) -> list[int]:
        return list(self.drafter.config.aux_hidden_state_layer_ids)

    def start(self) -> None:
        self.cache = DynamicCache()
        self.seen = 0  # context positions whose keys and values are cached

    @torch.no_grad()
    def propose(self, tokens: list[int], features: torch.Tensor, k: int) -> list[int]:
        d = self.drafter
        if k > self.block_size - 1:
            raise ValueError(f"k={k}: a DFlash block of {self.block_size} drafts at most {self.block_size - 1}")
        keep(self.cache, self.seen)
        n = len(tokens) - 1
        context = d.hidden_norm(d.fc(features[self.seen : n][None]))
        block = torch.tensor([[tokens[n]] + [d.mask_token_id] * (self.block_size - 1)])
        hidden = d.embed_tokens(block)
        positions = torch.arange(self.seen, n + self.block_size)[None]
        embeddings = d.rotary_emb(hidden, positions)
        for layer in d.layers:  # no mask: the block sees all of itself and the whole context before the anchor
            hidden = layer(hidden_states=hidden, target_hidden=context, attention_mask=None, position_ids=positions,
                           past_key_value=self.cache, position_embeddings=embeddings)  # fmt: skip
        # the cache now also holds the block's keys: keep the context only
        self.seen = n
        keep(self.cache, n)
        draft = d.lm_head(d.norm(hidden))[0, 1 : k + 1].argmax(-1)
        if d.use_draft_vocab:
            draft = draft + d.d2t[draft]
        return draft.tolist()

    @torch.no_grad()
    def speculators_forward(self, tokens: list[int], features: torch.Tensor, k: int) -> list[int]:
        """What speculators' own (training) forward drafts for one block anchored at the latest token."""
        d = self.drafter
        n = len(tokens) - 1
        length = n + self.block_size + 1  # its anchors leave the last block_size positions out
        ids = torch.tensor([tokens + [d.mask_token_id] * (length - len(tokens))])
        states = torch.cat([features[:n], torch.zeros(length - n, features.shape[1])])[None]
        anchor = torch.zeros(1, length, dtype=torch.long)
        anchor[0, n] = 1  # the only position its anchor selection may pick
        last = torch.zeros(1, length, d.config.transformer_layer_config.hidden_size)
        logits = d._backbone_forward(states, ids, anchor, last, torch.zeros(1, length, dtype=torch.long),
                                     max_anchors=1)[1]  # fmt: skip
        draft = logits[0, 1 : k + 1].argmax(-1)
        return (draft + d.d2t[draft] if d.use_draft_vocab else draft).tolist()


class OracleProposer:
    """Proposes the target's own greedy continuation (read from its plain greedy decoding, run on past the budget
    and past EOS): every draft must be accepted, so tau = k + 1 exactly, a check of the loop's bookkeeping (cache
    crops, acceptance, bonus token)."""

    layer_ids: ClassVar[list[int]] = []  # it reads no features

    def __init__(self, reference: list[int], prompt_length: int):
        self.reference = reference
        self.prompt_length = prompt_length

    def start(self) -> None:
        return None

    def propose(self, tokens: list[int], features: torch.Tensor, k: int) -> list[int]:
        done = len(tokens) - self.prompt_length
        return self.reference[done : done + k]
