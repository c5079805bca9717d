// Helpers for cross-process tests: child processes (tests/support/subprocess.h) and byte patterns that
// tell every byte of a transfer apart.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tests/support/subprocess.h"

namespace shardcast::testing {

using shardcast::Child;

inline std::string toHex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

inline std::string fromHex(const std::string& hex) {
  std::string out;
  auto val = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(val(hex[i]) * 16 + val(hex[i + 1])));
  return out;
}

// Deterministic bytes for verification: byte i of pattern `seed` (one hash per 8 bytes).
inline uint64_t patternWord(uint64_t seed, uint64_t w) {
  uint64_t x = (w + 1) * 0x9E3779B97F4A7C15ull ^ (seed + 1) * 0xD1B54A32D192ED03ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 32);
}

inline unsigned char patternByte(uint64_t seed, uint64_t i) {
  return static_cast<unsigned char>(patternWord(seed, i / 8) >> (8 * (i % 8)));
}

inline void fillPattern(unsigned char* p, size_t n, uint64_t seed, uint64_t start = 0) {
  uint64_t word = patternWord(seed, start / 8);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t g = start + i;
    if (g % 8 == 0) word = patternWord(seed, g / 8);
    p[i] = static_cast<unsigned char>(word >> (8 * (g % 8)));
  }
}

// Index of the first byte that differs from the pattern, or n.
inline size_t checkPattern(const unsigned char* p, size_t n, uint64_t seed, uint64_t start = 0) {
  uint64_t word = patternWord(seed, start / 8);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t g = start + i;
    if (g % 8 == 0) word = patternWord(seed, g / 8);
    if (p[i] != static_cast<unsigned char>(word >> (8 * (g % 8)))) return i;
  }
  return n;
}

}  // namespace shardcast::testing
