"""Which credit accounts (and so which tenants) the coordinator knows.

A grant or a tenant's weight names an account by text; a typo or a truncated principal id must
not open an account nobody can use. An account is known when something real names it:

- an entry of the ledger (whatever its balance, zero included);
- an enrolled principal (a ``principal.enrolled`` or ``principal.renewed`` event): a user's
  tenant account, a node's donor account;
- a job's owner (its tenant account), a tenant an operator gave a weight;
- a node the registry stored (its donor account: a node earns for itself unless its join token
  named a donor) and every donor a join token named.

Events are pruned after the retention period, so a user enrolled longer ago who never got
credits, submitted a job or was weighted is not known: the caller then asks to create the
account explicitly (``create`` in GrantCredits / SetTenantWeight).

`known_accounts` is the rule, pure; `gather` reads its inputs from the store.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from coordinator.accounting.credit_book import donor_account, tenant_account
from coordinator.core.errors import NotFoundError
from coordinator.store.base import Store
from epochmesh.identity import ROLE_NODE

# Events that name a principal the CA certified (attrs: principal, role).
PRINCIPAL_EVENTS = ("principal.enrolled", "principal.renewed")


@dataclass(frozen=True)
class Sightings:
    """Everything the store says about who exists."""

    ledger_accounts: Collection[str] = ()
    principals: Mapping[str, str] = field(default_factory=dict)  # principal id -> role
    job_owners: Collection[str] = ()
    weighted_tenants: Collection[str] = ()
    node_ids: Collection[str] = ()
    donors: Collection[str] = ()


def known_accounts(seen: Sightings) -> frozenset[str]:
    """The account names ``seen`` vouches for (see the module docstring)."""
    known: set[str] = set(seen.ledger_accounts)
    for principal, role in seen.principals.items():
        known.add(donor_account(principal) if role == ROLE_NODE else tenant_account(principal))
    known.update(tenant_account(owner) for owner in seen.job_owners if owner)
    known.update(tenant_account(t) for t in seen.weighted_tenants if t)
    known.update(donor_account(n) for n in seen.node_ids if n)
    known.update(donor_account(d) for d in seen.donors if d)
    return frozenset(known)


def known_tenants(accounts: Iterable[str]) -> list[str]:
    """The principal ids of the tenant accounts among ``accounts``, sorted."""
    return sorted(a.removeprefix("tenant:") for a in accounts if a.startswith("tenant:"))


async def gather(store: Store) -> Sightings:
    """The store's sightings (a few reads; for the rare calls that name an account)."""
    events = await store.list_events(kinds=PRINCIPAL_EVENTS, limit=0)
    principals = {
        e.attrs["principal"]: e.attrs.get("role", "") for e in events if e.attrs.get("principal")
    }
    node_donors = await store.list_node_donors()
    return Sightings(
        ledger_accounts=list(await store.ledger_balances()),
        principals=principals,
        job_owners={j.owner for j in await store.list_jobs()},
        weighted_tenants=list(await store.list_tenant_weights()),
        node_ids=[n.info.node_id for n in await store.list_nodes()] + list(node_donors),
        donors=list(node_donors.values()),
    )


async def require_known(store: Store, account: str, named: str) -> None:
    """NotFoundError unless the store knows ``account``; ``named`` is how the caller named it
    in the message (e.g. "tenant 'u-...'")."""
    if account in known_accounts(await gather(store)):
        return
    raise NotFoundError(
        f"unknown {named}: no enrolled principal, job, node, tenant weight or ledger entry "
        "names it (ask to create it to open it anyway)"
    )
