from collections.abc import Iterator

import pytest
from support.multirank import Ranks


@pytest.fixture(scope="session")
def ranks() -> Iterator[Ranks]:
    """Run test bodies on N real gloo ranks: ``ranks.run(4, body, *args)`` returns each rank's result."""
    pool = Ranks()
    yield pool
    pool.close()
