// JSON Schema string `format`s as regular expressions (grammar/regex.h), for json_schema.cpp.
//
// Each is a subset of the format's RFC, never a superset, so a constrained value passes a strict
// format checker; where the RFC's whole language is regular and short it is the whole language:
//   date       RFC 3339 full-date, years 0001–9999, each month's days, 29 February in leap years only
//   time       RFC 3339 full-time: HH:MM:SS, optional fraction, then Z or ±HH:MM (no leap second)
//   date-time  date "T" time
//   uuid       RFC 4122 text: 8-4-4-4-12 hex digits
//   ipv4       dotted quad, octets 0–255 without leading zeros
//   ipv6       RFC 4291 §2.2 text forms (with :: compression, optional dotted-quad tail)
//   hostname   RFC 1123 labels (letters, digits, inner '-'), 1–62 characters, at most 4 labels
//              (so the name stays within 253 characters)
//   email      dot-atoms of RFC 5322 atext (≤ 3 atoms of ≤ 20) "@" a hostname
//   uri        RFC 3986 absolute URI: scheme ":" hier-part [ "?" query ] [ "#" fragment ]
#pragma once
#include <optional>
#include <string>
#include <string_view>

namespace kd::grammar {

// The anchored regex for a format, or nullopt for a format not listed above.
std::optional<std::string> format_regex(std::string_view format);

// The names above, for messages ("date, time, …").
const char* supported_formats();

}  // namespace kd::grammar
