# Ships the C++ sources as package data (fastzero._csrc) for the just-in-time build.
