"""Record stores (SINGA's kvfile and textfile), in-memory datasets, and `shoal prepare`."""
from shoal.data.dataset import Dataset, clear_cache, load_mean, normalise, open_store
from shoal.data.errors import StoreError
from shoal.data.kvfile import KVFileWriter, read_kvfile, scan_kvfile

__all__ = ["Dataset", "KVFileWriter", "StoreError", "clear_cache", "load_mean", "normalise", "open_store", "read_kvfile", "scan_kvfile"]
