import pytest

from tests.passes.tiny import ARCHS


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param
