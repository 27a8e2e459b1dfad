"""The one rule that tells a bucket's URI from a folder's path, and the local backend's
key checks (the S3 backend's contract: tests/integration/test_object_storage.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from orthornn.export.artifacts import repository
from orthornn.export.artifacts.storage import check_location, folder_only, is_object_uri
from orthornn.export.artifacts.storage.store import check_key, split_uri


@pytest.mark.parametrize("location", ["repo", "/srv/models", "./a:b", "models/s3/x",
                                      "s3://models", "s3://models/repo/",
                                      "s3://my.bucket-1/a/b/c"])
def test_folders_and_well_formed_uris_are_taken_as_given(location):
    assert check_location(location, "--repo") == location


@pytest.mark.parametrize("location, message", [
    ("s3:/models/repo", "is not a URI (s3://BUCKET[/PREFIX], two slashes)"),
    ("S3:/models", "is not a URI"),
    ("gs://models/repo", "is a gs:// URI; a location is a local folder or s3://BUCKET"),
    ("file:///srv", "is a file:// URI"),
    ("s3://", "the bucket must be 3-63"),
    ("s3://ab/x", "the bucket must be 3-63"),
    ("s3://Models/x", "the bucket must be 3-63"),
    ("s3://-models/x", "the bucket must be 3-63"),
    ("s3://models//x", "the prefix has an empty, '.' or '..' part"),
    ("s3://models/a/../b", "the prefix has an empty, '.' or '..' part"),
])
def test_a_malformed_location_is_refused_naming_the_setting(location, message):
    with pytest.raises(ValueError, match=r"^--repo: ") as error:
        check_location(location, "--repo")
    assert message in str(error.value)


def test_a_models_location_in_a_bucket_stays_a_uri():
    assert repository.model_location("s3://models/repo/", "digits") == "s3://models/repo/digits"
    assert repository.model_location("repo", "digits") == Path("repo/digits")
    assert repository.version_of("s3://models/repo/digits/12") == 12
    assert split_uri("s3://models/a/b/") == ("models", "a/b")
    assert is_object_uri("s3://models") and not is_object_uri(Path("s3:/models"))


def test_what_reads_a_folder_only_refuses_a_bucket_by_name():
    assert folder_only("repo", "--repo") == Path("repo")
    with pytest.raises(ValueError, match=r"^--capture: s3://models/c is a bucket"):
        folder_only("s3://models/c", "--capture")


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "..", "./a"])
def test_a_key_that_could_leave_the_store_is_refused(key):
    with pytest.raises(ValueError, match="must be relative"):
        check_key(key)



def test_only_plain_file_names_under_a_number_are_a_versions_files():
    from orthornn.export.artifacts import remote

    keys = ["1/manifest.json", "1/model.onnx", "1/..", "1/.", "1/sub/x", "2/.claim",
            "promotion.json", "x1/manifest.json", "rejected/a/gate.json"]
    assert remote.numbered(keys) == {1: {"manifest.json", "model.onnx"}, 2: {".claim"}}
