"""The apiserver refuses the integers `kiln validate` refuses (issue 13, item 10): one past each field's
int32 or ±(2^53 - 1) bound, through the generated CRD's `maximum`s, with the same field path."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from kiln.api.load import parse
from kiln.errors import KilnError
from tests.support.operator import create_dry_run, kube, refused_fields  # noqa: F401 - fixtures
from tests.support.specs import SPEC_INTS, doc_with

pytestmark = pytest.mark.rig


@pytest.mark.parametrize("path", sorted(SPEC_INTS))
def test_apiserver_and_kiln_refuse_one_past_each_integer_bound(kube, namespace, path):  # noqa: F811
    body = doc_with(path, SPEC_INTS[path]["maximum"] + 1)
    with pytest.raises(KilnError) as err:
        parse(body, "f.yaml")
    assert f"f.yaml: {path.replace('[]', '.0')}:" in str(err.value)
    with pytest.raises(ApiException) as refused:
        create_dry_run(kube, namespace, body)
    assert refused.value.status == 422, refused.value.body
    assert path.replace("[]", "[0]") in refused_fields(refused.value), refused.value.body


def test_apiserver_refuses_an_integer_beyond_int64(kube, namespace):  # noqa: F811
    body = doc_with("spec.training.steps", 2**64)
    with pytest.raises(ApiException) as refused:
        create_dry_run(kube, namespace, body)
    assert refused.value.status in (400, 422), refused.value.body
