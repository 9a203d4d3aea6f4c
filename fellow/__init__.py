"""The fellow: a torch-free agent on each GPU node; torch lives only in fellow/runtime/."""
