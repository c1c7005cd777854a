// The emulation drivers' files (tests/emu/*_main.cpp): the input is int64 words, read whole by
// emu_open; the output, int64 words written by put (emu_finish: several arrays, then the close).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <vector>

inline std::vector<long long> emu_in;
inline std::size_t emu_at = 0;
inline const char* emu_driver = "emu";   // the driver's name, for its messages

// argv[1] read into emu_in; the opened argv[2] (nullptr, after a message, on any failure)
inline std::FILE* emu_open(int argc, char** argv, const char* driver) {
    emu_driver = driver;
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s IN OUT\n", driver);
        return nullptr;
    }
    std::FILE* fi = std::fopen(argv[1], "rb");
    if (!fi) {
        std::fprintf(stderr, "%s: cannot read %s\n", driver, argv[1]);
        return nullptr;
    }
    long long v;
    while (std::fread(&v, 8, 1, fi) == 1) emu_in.push_back(v);
    std::fclose(fi);
    std::FILE* fo = std::fopen(argv[2], "wb");
    if (!fo) std::fprintf(stderr, "%s: cannot write %s\n", driver, argv[2]);
    return fo;
}

// the next input word; exit code 2 if the input has ended
inline long long next() {
    if (emu_at >= emu_in.size()) {
        std::fprintf(stderr, "%s: input ends early\n", emu_driver);
        std::exit(2);
    }
    return emu_in[emu_at++];
}

template <class T>
void put(std::FILE* f, const T* a, long long n) {
    for (long long i = 0; i < n; ++i) {
        const long long v = static_cast<long long>(a[i]);
        std::fwrite(&v, 8, 1, f);
    }
}

template <class T>
void put(std::FILE* f, const std::vector<T>& a) {
    put(f, a.data(), (long long)a.size());
}

// Each array in order, then the file closed: a driver's last step, whose exit code it returns.
template <class... V>
int emu_finish(std::FILE* f, const V&... arrays) {
    (put(f, arrays), ...);
    std::fclose(f);
    return 0;
}
