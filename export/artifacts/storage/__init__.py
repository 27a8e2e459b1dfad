"""Where a repository, its records and the loop's data live: a local folder or an
S3-compatible bucket (``s3://bucket/prefix``), behind one small interface (``store.py``):
read, read-if-changed, write, write-if-absent, write-if-unchanged, list, delete.

``open_store(uri, setting)`` gives the backend for a location (``local.py``, a folder;
``s3.py``, obstore's S3 client, configured as the AWS tools are); ``check_location``
refuses a URI of any other scheme with one line naming the setting. ``remote.mirror``
copies a model of a store into a local folder laid out as a repository, so that everything that
reads a version's files (the package checks, onnxruntime) reads them from a disk.
"""

from .local import Local
from .s3 import S3
from .store import (
    Blob,
    Changed,
    Exists,
    Store,
    check_location,
    folder_only,
    is_object_uri,
    local_folder,
)

__all__ = [
    "S3",
    "Blob",
    "Changed",
    "Exists",
    "Local",
    "Store",
    "check_location",
    "folder_only",
    "is_object_uri",
    "local_folder",
    "open_store",
]


def open_store(location: str, setting: str = "--repo") -> Store:
    """The store of LOCATION (a folder, or ``s3://bucket/prefix``); ValueError naming
    SETTING for a malformed location. Nothing is requested yet (``check`` does)."""
    check_location(location, setting)
    if is_object_uri(location):
        return S3(location, setting)
    return Local(location)
