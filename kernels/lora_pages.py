"""The paged adapter layout (services/inference/lora/pool.py, docs/architecture.md "LoRA pool
layout") for the kernels' references and checks: gather a pool's pages back into the per-slot,
rank-padded tensors, and spread such tensors over pages through a page table.

A: `[pages, n*P, d]` <-> `[slots, n*R, d]` (stack `i`, rank row `j`: page `pages[s, j // P]`, row
`i*P + j % P`); B: `[pages, P, W]` <-> `[slots, W, R]` (rank row `j`: page `pages[s, j // P]`, row
`j % P`). Rows past `ceil(R/P)*P` do not exist in the padded form; entries of the page table past a
slot's own pages read whatever page they name (the rank masks them).
"""

from __future__ import annotations

import torch


def _rows(pages: torch.Tensor, max_rank: int, page_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot and rank row `j < R`: its page and its row within the page."""
    j = torch.arange(max_rank, device=pages.device)
    return pages.to(torch.int64)[:, j // page_rows], j % page_rows


def unpage_a(A: torch.Tensor, pages: torch.Tensor, n_stack: int, max_rank: int) -> torch.Tensor:
    """`[pages, n*P, d]` through `pages` `[slots, ceil(R/P)]` -> `[slots, n*R, d]`."""
    page_rows = A.shape[1] // n_stack
    page, row = _rows(pages, max_rank, page_rows)  # [slots, R], [R]
    stacks = [A[page, i * page_rows + row] for i in range(n_stack)]  # each [slots, R, d]
    return torch.cat(stacks, dim=1)


def unpage_b(B: torch.Tensor, pages: torch.Tensor, max_rank: int) -> torch.Tensor:
    """`[pages, P, W]` through `pages` -> `[slots, W, R]`."""
    page, row = _rows(pages, max_rank, B.shape[1])
    return B[page, row].transpose(1, 2)  # [slots, R, W] -> [slots, W, R]


def page_a(
    dense: torch.Tensor, pages: torch.Tensor, own: list[int], n_stack: int, num_pages: int, page_rows: int
) -> torch.Tensor:
    """`[slots, n*R, d]` -> a fresh `[num_pages, n*P, d]` holding the rows of slot `s`'s first
    `own[s]` pages (the rest of its padded rows are dropped; pages no slot owns are NaN, so a read of
    them shows)."""
    slots, nr, d = dense.shape
    max_rank = nr // n_stack
    out = torch.full(
        (num_pages, n_stack * page_rows, d), float("nan"), dtype=dense.dtype, device=dense.device
    )
    page, row = _rows(pages, max_rank, page_rows)
    for s in range(slots):
        k = min(own[s] * page_rows, max_rank)
        for i in range(n_stack):
            out[page[s, :k], i * page_rows + row[:k]] = dense[s, i * max_rank : i * max_rank + k]
    return out


def page_b(
    dense: torch.Tensor, pages: torch.Tensor, own: list[int], num_pages: int, page_rows: int
) -> torch.Tensor:
    """`[slots, W, R]` -> a fresh `[num_pages, P, W]` (as `page_a`: slot `s`'s first `own[s]` pages)."""
    slots, width, max_rank = dense.shape
    out = torch.full((num_pages, page_rows, width), float("nan"), dtype=dense.dtype, device=dense.device)
    page, row = _rows(pages, max_rank, page_rows)
    for s in range(slots):
        k = min(own[s] * page_rows, max_rank)
        out[page[s, :k], row[:k]] = dense[s, :, :k].t()
    return out
