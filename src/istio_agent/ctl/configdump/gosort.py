"""Go's ``sort.Slice``: pattern-defeating quicksort, so items that compare equal land where Go puts them.

istioctl sorts with ``sort.Slice``, which is not stable, and some of its comparisons are not even
orderings (routes whose names are not numbers compare as "not less" both ways). A stable sort would
print some tables in another order than istioctl; this follows the steps of Go's algorithm (insertion
sort up to 12 items, median-of-three or Tukey's ninther pivots, a deterministic xorshift to break
patterns, heapsort after too many bad pivots) so the order is the same, ties included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_MASK = (1 << 64) - 1


def sort_slice(items: list[T], less: Callable[[T, T], bool]) -> None:
    """Sort ``items`` in place as Go's ``sort.Slice(items, less)`` does."""
    _Sorter(items, less).run()


class _Sorter:
    def __init__(self, items: list[T], less: Callable[[T, T], bool]) -> None:
        self.items = items
        self.less_fn = less

    def less(self, i: int, j: int) -> bool:
        return self.less_fn(self.items[i], self.items[j])

    def swap(self, i: int, j: int) -> None:
        self.items[i], self.items[j] = self.items[j], self.items[i]

    def run(self) -> None:
        n = len(self.items)
        self.pdqsort(0, n, n.bit_length())

    def insertion(self, a: int, b: int) -> None:
        for i in range(a + 1, b):
            j = i
            while j > a and self.less(j, j - 1):
                self.swap(j, j - 1)
                j -= 1

    def sift_down(self, lo: int, hi: int, first: int) -> None:
        root = lo
        while True:
            child = 2 * root + 1
            if child >= hi:
                return
            if child + 1 < hi and self.less(first + child, first + child + 1):
                child += 1
            if not self.less(first + root, first + child):
                return
            self.swap(first + root, first + child)
            root = child

    def heapsort(self, a: int, b: int) -> None:
        first, hi = a, b - a
        for i in range((hi - 1) // 2, -1, -1):
            self.sift_down(i, hi, first)
        for i in range(hi - 1, -1, -1):
            self.swap(first, first + i)
            self.sift_down(0, i, first)

    def pdqsort(self, a: int, b: int, limit: int) -> None:
        balanced, partitioned = True, True
        while True:
            length = b - a
            if length <= 12:
                self.insertion(a, b)
                return
            if limit == 0:
                self.heapsort(a, b)
                return
            if not balanced:
                self.break_patterns(a, b)
                limit -= 1
            pivot, hint = self.choose_pivot(a, b)
            if hint == "decreasing":
                self.reverse(a, b)
                pivot = (b - 1) - (pivot - a)
                hint = "increasing"
            if balanced and partitioned and hint == "increasing" and self.partial_insertion(a, b):
                return
            if a > 0 and not self.less(a - 1, pivot):
                a = self.partition_equal(a, b, pivot)
                continue
            mid, partitioned = self.partition(a, b, pivot)
            left, right = mid - a, b - mid
            threshold = length // 8
            if left < right:
                balanced = left >= threshold
                self.pdqsort(a, mid, limit)
                a = mid + 1
            else:
                balanced = right >= threshold
                self.pdqsort(mid + 1, b, limit)
                b = mid

    def partition(self, a: int, b: int, pivot: int) -> tuple[int, bool]:
        self.swap(a, pivot)
        i, j = a + 1, b - 1
        while i <= j and self.less(i, a):
            i += 1
        while i <= j and not self.less(j, a):
            j -= 1
        if i > j:
            self.swap(j, a)
            return j, True
        self.swap(i, j)
        i, j = i + 1, j - 1
        while True:
            while i <= j and self.less(i, a):
                i += 1
            while i <= j and not self.less(j, a):
                j -= 1
            if i > j:
                break
            self.swap(i, j)
            i, j = i + 1, j - 1
        self.swap(j, a)
        return j, False

    def partition_equal(self, a: int, b: int, pivot: int) -> int:
        self.swap(a, pivot)
        i, j = a + 1, b - 1
        while True:
            while i <= j and not self.less(a, i):
                i += 1
            while i <= j and self.less(a, j):
                j -= 1
            if i > j:
                break
            self.swap(i, j)
            i, j = i + 1, j - 1
        return i

    def partial_insertion(self, a: int, b: int) -> bool:
        i = a + 1
        for _ in range(5):
            while i < b and not self.less(i, i - 1):
                i += 1
            if i == b:
                return True
            if b - a < 50:
                return False
            self.swap(i, i - 1)
            if i - a >= 2:
                for j in range(i - 1, 0, -1):
                    if not self.less(j, j - 1):
                        break
                    self.swap(j, j - 1)
            if b - i >= 2:
                for j in range(i + 1, b):
                    if not self.less(j, j - 1):
                        break
                    self.swap(j, j - 1)
        return False

    def break_patterns(self, a: int, b: int) -> None:
        length = b - a
        if length < 8:
            return
        random = length
        modulus = 1 << length.bit_length()
        idx = a + (length // 4) * 2 - 1
        for i in range(3):
            random ^= (random << 13) & _MASK
            random ^= random >> 7
            random ^= (random << 17) & _MASK
            other = random & (modulus - 1)
            if other >= length:
                other -= length
            self.swap(idx - 1 + i, a + other)

    def choose_pivot(self, a: int, b: int) -> tuple[int, str]:
        length = b - a
        swaps = [0]
        i, j, k = a + length // 4, a + length // 4 * 2, a + length // 4 * 3
        if length >= 8:
            if length >= 50:
                i = self.median(i - 1, i, i + 1, swaps)
                j = self.median(j - 1, j, j + 1, swaps)
                k = self.median(k - 1, k, k + 1, swaps)
            j = self.median(i, j, k, swaps)
        if swaps[0] == 0:
            return j, "increasing"
        if swaps[0] == 12:
            return j, "decreasing"
        return j, "unknown"

    def order2(self, a: int, b: int, swaps: list[int]) -> tuple[int, int]:
        if self.less(b, a):
            swaps[0] += 1
            return b, a
        return a, b

    def median(self, a: int, b: int, c: int, swaps: list[int]) -> int:
        a, b = self.order2(a, b, swaps)
        b, c = self.order2(b, c, swaps)
        a, b = self.order2(a, b, swaps)
        return b

    def reverse(self, a: int, b: int) -> None:
        i, j = a, b - 1
        while i < j:
            self.swap(i, j)
            i, j = i + 1, j - 1
