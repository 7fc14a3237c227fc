"""CREDIT's gen2 entry point, ``credit.applications.train_gen2``, run by ``torchrun`` as a user
runs it, with a recorder that only reads.

Usage: ``torchrun --nproc-per-node 4 credit_run.py RECORD -c CONFIG --backend gloo``: CREDIT's own
``main_cli`` trains with ``CONFIG``; each rank writes what it saw to ``RECORD.<rank>.json``. The
recorder takes the objects CREDIT builds as they are returned (the model, optimizer and scaler
from ``load_model_states_and_optimizer``, the training loss from ``load_loss``) and calls the
originals unchanged. After each ``scaler.update()`` it records a digest of this rank's shards of
the weights, and, where the scaler holds a spike policy, the scaler's and the policy's answers,
then proves every copy of every weight and AdamW state bit-identical across the ranks
(:func:`credit.parallel.replicas.verify_replicas`: a mismatch raises and ends the run). It
records each micro-step's loss on this rank as the loss module returns it, and, at the end, the
policy's state.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _bytes(tensor: torch.Tensor) -> bytes:
    """This rank's elements of ``tensor`` (its shard of a DTensor), as raw bytes."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _digest(tensors: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(_bytes(tensor))
    return digest.hexdigest()


def _bits(value: Any) -> Any:
    """A state entry as exact text: tensors as the hex of their bytes."""
    if isinstance(value, torch.Tensor):
        return _bytes(value).hex()
    if isinstance(value, dict):
        return {str(key): _bits(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bits(item) for item in value]
    return float(value).hex() if isinstance(value, float) else value


def _watch(model: Any, optimizer: Any, scaler: Any, record: dict[str, Any]) -> None:
    """Record after each of the scaler's updates, and verify the replicas."""
    from credit.parallel.replicas import verify_replicas

    verify_at = {int(n) for n in os.environ.get("CREDIT_RUN_VERIFY_AT", "").split(",") if n}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    record["digest_start"] = _digest(params)
    update = scaler.update

    def update_and_record(*args: Any, **kwargs: Any) -> None:
        update(*args, **kwargs)
        entry: dict[str, Any] = {"digest": _digest(params)}
        policy = scaler.spike_policy() if hasattr(scaler, "spike_policy") else None
        if policy is not None:
            entry.update(
                skipped=scaler.last_step_skipped,
                skipped_steps=scaler.skipped_steps,
                spikes=policy.skipped_spikes,
                non_finite=policy.skipped_non_finite,
                norm=float(policy.metrics()["norm"]).hex(),
            )
        record["steps"].append(entry)
        if entry.get("skipped") or len(record["steps"]) in verify_at:
            verify_replicas(model, optimizer)
            entry["verified"] = True
        record["policy"] = policy

    scaler.update = update_and_record


def main() -> None:
    record_path, *credit_args = sys.argv[1:]
    import credit.applications.train_gen2 as train_gen2
    import credit.losses

    record: dict[str, Any] = {"steps": [], "losses": [], "policy": None}
    load_states = train_gen2.load_model_states_and_optimizer
    load_loss = credit.losses.load_loss

    def load_states_and_watch(conf: dict, model: Any, device: Any) -> tuple:
        conf, model, optimizer, scheduler, scaler = load_states(conf, model, device)
        _watch(model, optimizer, scaler, record)
        return conf, model, optimizer, scheduler, scaler

    def load_loss_and_watch(conf: dict, validation: bool = False) -> Any:
        criterion = load_loss(conf, validation=validation)
        if not validation:
            losses = record["losses"]
            criterion.register_forward_hook(lambda m, i, out: losses.append(out.mean().item()))
        return criterion

    train_gen2.load_model_states_and_optimizer = load_states_and_watch
    credit.losses.load_loss = load_loss_and_watch
    sys.argv = [train_gen2.__file__, *credit_args]
    train_gen2.main_cli()

    policy = record.pop("policy")
    record["policy_state"] = _bits(policy.state_dict()) if policy is not None else None
    with open(f"{record_path}.{os.environ['RANK']}.json", "w") as file:
        json.dump(record, file)


if __name__ == "__main__":
    main()
