"""What the edge's tenancy policy reads of a connection, as a plain value for unit tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker_edge.plim import TenantUsage
from broker_edge.tenants import ALLOW_ALL, Acl


@dataclass
class Client:
    """What the policy reads of a connection; the policy never writes into it."""

    tenant: str
    client_id: str
    operator: bool = False
    acl: Acl = field(default_factory=lambda: ALLOW_ALL)
    max_payload: int = 0
    usage: TenantUsage = field(default_factory=TenantUsage)
