// libstrata.so (cmake/package.cmake) is the layers' static libraries linked whole; this file is
// the one source a shared library target must have. It defines nothing.
