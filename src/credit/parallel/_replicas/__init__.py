"""The replica check: every copy of every parameter, buffer and optimizer state proven
bit-identical in one all_reduce, and the copies that differ diagnosed and repaired.

``replicas.verify_replicas`` calls the steps below in order: ``request``, ``plan``, ``prove``
and, on a failed proof only, ``settle``.
"""

from credit.parallel._replicas.arguments import request
from credit.parallel._replicas.messages import WHAT, listed
from credit.parallel._replicas.plan import plan
from credit.parallel._replicas.proof import prove
from credit.parallel._replicas.records import Mismatch
from credit.parallel._replicas.settle import settle

__all__ = ["WHAT", "Mismatch", "listed", "plan", "prove", "request", "settle"]
