"""/generate for language models: the full graph reads the prompt once, then the one-step
graph produces each new token from the carried hidden state (the prefix is never re-run)."""

from __future__ import annotations

import numpy as np
from orthornn.export.artifacts.package import INITIAL_STATE
from orthornn.export.artifacts.vocabulary import EOS

from ..errors import ClientError
from ..registry.runtime import Runtime
from ..registry.spec import ModelSpec
from .checks import check_output_budget
from .schemas import GenerateRequest


def piece_length(spec: ModelSpec, budget: int) -> int:
    """The longest piece of a prompt whose logits (T x V x 4 bytes) fit BUDGET (0: any)."""
    return max(1, budget // (4 * spec.output_size)) if budget else 1 << 62


def prompt_ids(spec: ModelSpec, req: GenerateRequest, max_new_tokens: int,
               output_budget: int = 0) -> list[int]:
    if spec.task != "lm" or spec.vocabulary is None:
        raise ClientError(f"model: {spec.name!r} is a {spec.task} model; /generate needs a "
                          f"language model")
    if req.max_new_tokens > max_new_tokens:
        raise ClientError(f"max_new_tokens: at most {max_new_tokens}; got {req.max_new_tokens}")
    vocab = len(spec.vocabulary)
    if req.top_k is not None and req.top_k > vocab:
        raise ClientError(f"top_k: at most the vocabulary size {vocab}; got {req.top_k}")
    if isinstance(req.prompt, str):
        ids = spec.encode(req.prompt)
    else:
        ids = list(req.prompt)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ClientError(f"prompt: token ids must be in [0, {vocab - 1}]; got {bad[0]}")
    if len(ids) > spec.max_length:
        raise ClientError(f"prompt: at most {spec.max_length} tokens; got {len(ids)}")
    if not spec.streaming:  # read in one piece: its logits must fit the budget
        check_output_budget(spec, 1, len(ids), output_budget)
    return ids


def _pick(logits: np.ndarray, req: GenerateRequest, rng: np.random.Generator,
          banned: int | None = None) -> int:
    logits = logits.astype(np.float64)
    if banned is not None:  # <unk> unless the request allows it
        logits[banned] = -np.inf
    if req.temperature == 0:
        return int(np.argmax(logits))
    z = logits / req.temperature
    if req.top_k is not None:
        cut = np.sort(z)[-req.top_k]
        z = np.where(z >= cut, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    return int(rng.choice(len(p), p=p))


def read_prompt(runtime: Runtime, spec: ModelSpec, context: list[int], budget: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """The last step's logits [V] and the state after CONTEXT, read by the full graph in
    pieces whose logits fit BUDGET (the state carried from piece to piece), so that a long
    prompt of a large vocabulary never builds T x V at once."""
    piece = piece_length(spec, budget) if spec.streaming else len(context)
    state = None
    for begin in range(0, len(context), piece):
        part = context[begin:begin + piece]
        feeds = {"tokens": np.array([part], dtype=np.int64),
                 "lengths": np.array([len(part)], dtype=np.int64)}
        if state is not None:
            feeds[INITIAL_STATE] = state
        out = runtime.run("model", feeds)
        logits, state = out["logits"][0, len(part) - 1].copy(), out["state"]
        del out
    assert state is not None
    return logits, state


def generate(runtime: Runtime, spec: ModelSpec, prompt: list[int], req: GenerateRequest,
             output_budget: int = 0) -> dict:
    """Runs in an inference thread; ``prompt_ids`` has checked the model is a language
    model with a vocabulary."""
    assert spec.vocabulary is not None
    eos = spec.token_ids.get(EOS, 1)
    context = prompt or [eos]  # an empty prompt starts a new paragraph
    logits, state = read_prompt(runtime, spec, context, output_budget)
    rng = np.random.default_rng(req.seed)
    banned = None if req.allow_unk else spec.unk_id
    ids: list[int] = []
    reason = "length"
    for i in range(req.max_new_tokens):
        token = _pick(logits, req, rng, banned)
        ids.append(token)
        if req.stop_at_eos and token == eos:
            reason = "eos"
            break
        if i + 1 == req.max_new_tokens:
            break
        step = runtime.run("step", {"tokens": np.array([[token]], dtype=np.int64),
                                    "state": state})
        logits, state = step["logits"][0, 0], step["next_state"]
    tokens = [spec.vocabulary[t] for t in ids]
    text = " ".join(t for t in tokens if t != EOS)
    return {"prompt_ids": prompt, "ids": ids, "tokens": tokens, "text": text,
            "finish_reason": reason}
