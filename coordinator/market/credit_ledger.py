"""The credit ledger at run time: a `CreditBook` kept in step with the store's entries.

A posting is checked against the balances and applied to them before anything is awaited (two
postings cannot both spend the same credits), then written; when the write fails the book is
read back from the store. A posting made inside a caller's store transaction (a round record
and its charges) is written in that transaction: should the caller's transaction fail after
the posting, the caller calls `reload()`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from coordinator.accounting.credit_book import CreditBook, Entry
from coordinator.store.base import Store

log = logging.getLogger(__name__)


class CreditLedger:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._book = CreditBook()

    async def reload(self) -> None:
        """The balances as the store's entries sum them."""
        self._book = CreditBook(await self._store.ledger_balances())

    def balance(self, account: str) -> int:
        return self._book.balance(account)

    def balances(self) -> dict[str, int]:
        """Every account with a non-zero balance."""
        return self._book.balances()

    async def post(self, entries: Sequence[Entry]) -> list[int]:
        """Write ``entries`` all or nothing; their ids. ValueError / InsufficientCredits
        (nothing written) when they would break the book's rules."""
        if not entries:
            return []
        before = self._book
        self._book = CreditBook(before.check(entries))
        try:
            return await self._store.add_ledger_entries(entries)
        except BaseException:
            log.warning("a ledger posting was not written; reading the balances back")
            self._book = before
            await self.reload()
            raise
