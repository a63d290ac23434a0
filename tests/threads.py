"""A module-scoped fixture that runs a test module on one torch thread (imported as ``tests.threads``):
``from tests.threads import one_thread as _one_thread`` in the module makes it autouse there."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """torch.set_num_threads(1) for the module's tests, the previous count restored after them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
