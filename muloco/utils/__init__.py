"""Small utilities that know nothing of training: files written whole, folders made as the umask
says, optional dependencies, free ports, command lines parsed from a dataclass."""
