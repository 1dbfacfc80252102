"""What a worker signs: the RoundReport of each round it contributed to, once it holds the round's
checkpoint θ⁽ʳ⁾ and has checked its held-out claims.

The check (trainer.data.shared_eval): the coordinator's per-batch held-out losses are checked whole, and
this worker's share of the batches re-evaluated on θ⁽ʳ⁾; a wrong claim in the share and the worker
refuses to sign. The report restates what the worker pushed (the update's digest, its train loss,
tokens, steps and bytes) and what it was sent (θ⁽ʳ⁾, the manifest, the round's parent θ⁽ʳ⁻¹⁾), and is
signed with the worker's attested key over the run's EIP-712 domain.

Reports never wait on training: the coordinator records round r ``--report-timeout`` after
publishing θ⁽ʳ⁾ with the reports it holds by then (settlement.report_book), so the overlapped loop
reports from its exchange thread while the next round trains (trainer.worker.loops). The check then
runs on a model of its own, touching nothing the training thread uses.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import torch

from attestation import RoundReport, SignedReport
from proto import pb
from storage_client import CID, to_e6
from trainer.config import RunConfig
from trainer.data.shared_eval import eval_share, shared_evaluation_problem
from trainer.model.params import bind_params, load_params
from trainer.runtime.inner import evaluate_batches
from trainer.worker.client import Checkpoint, CoordinatorClient, PhaseSeconds

if TYPE_CHECKING:
    from trainer.worker.role import Pushed

log = logging.getLogger("dilocox.worker")


class Reporter:
    """Checks θ⁽ʳ⁾ on ``eval_model`` and signs and submits the round's report (``bind``: see ``load``)."""

    def __init__(self, client: CoordinatorClient, config: RunConfig, shard_index: int, data_digest: bytes,
                 eval_batches: list, eval_model: torch.nn.Module, phase_seconds: PhaseSeconds,
                 keep_receipt: Callable[[pb.Receipt | None, int, bytes, bytes], object] | None = None,
                 bind: bool = False) -> None:
        self.client, self.config, self.shard_index, self.data_digest = client, config, shard_index, data_digest
        self.eval_batches, self.eval_model, self.phase_seconds = eval_batches, eval_model, phase_seconds
        # ``eval_model`` is the reporter's own (nothing trains it): it computes with θ⁽ʳ⁾'s own tensors
        # (trainer.model.params.bind_params), no second copy of the parameters; else θ⁽ʳ⁾ is copied in.
        self.load = bind_params if bind else load_params
        # Checks and keeps the coordinator's report receipt (trainer.worker.receipts.ReceiptBook.keep_sent).
        self.keep_receipt = keep_receipt

    def report(self, pushed: Pushed | None, checkpoint: Checkpoint) -> None:
        """Sign and submit the RoundReport of a round this worker contributed to, as soon as the
        round's checkpoint is in hand (nothing when the run has no ledger or ``checkpoint`` is
        another round's)."""
        client = self.client
        if pushed is None or checkpoint.round != pushed.round or client.domain is None:
            return
        assert client.key is not None
        started = time.perf_counter()
        problem = self.evaluation_problem(checkpoint)
        self.phase_seconds.add("evaluate", time.perf_counter() - started)
        if problem is not None:
            log.error("round %d: refusing to sign: %s", pushed.round, problem)
            return
        report = RoundReport(
            run_id=client.run_digest, round=pushed.round, worker=client.key.address, parent_checkpoint=pushed.parent,
            checkpoint=CID.parse(checkpoint.params_cid).digest, manifest_digest=CID.parse(checkpoint.manifest_cid).digest,
            update_digest=pushed.update, data_digest=self.data_digest, train_loss_e6=pushed.train_loss_e6,
            eval_loss_e6=checkpoint.eval_loss_e6, tokens=pushed.tokens, inner_steps=pushed.inner_steps,
            bytes_sent=pushed.bytes_sent, bytes_received=pushed.bytes_received,
        )
        digest = report.digest(client.domain)
        receipt = client.submit_report(SignedReport(report, client.key.sign_digest(digest)))
        if self.keep_receipt is not None:
            self.keep_receipt(receipt, pushed.round, pushed.update, digest)

    def evaluation_problem(self, checkpoint: Checkpoint) -> str | None:
        """What is wrong with the checkpoint's claimed held-out losses, or None: the claims are
        checked whole and this worker's share of the batches re-evaluated (trainer.data.shared_eval), with
        the process's torch threads (a few batches, beside the training's)."""
        cfg = self.config
        share = eval_share(cfg.data.eval_batches, cfg.rounds.expected_workers, self.shard_index)
        self.load(self.eval_model, checkpoint.params)
        with torch.no_grad():
            losses = evaluate_batches(self.eval_model, [self.eval_batches[j] for j in share]) if share else []
        return shared_evaluation_problem(checkpoint.eval_losses_e6, cfg.data.eval_batches, checkpoint.eval_loss_e6,
                                         {j: to_e6(loss) for j, loss in zip(share, losses)})
