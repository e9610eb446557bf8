#include "grammar/json_format.h"

namespace kd::grammar {

namespace {

// Written from the RFCs' ABNF (RFC 3339 §5.6, RFC 4291 §2.2 / RFC 3986 §3.2.2, RFC 1123 §2.1,
// RFC 3986 §3).
const std::string kDate = [] {
  const std::string month_day =
      "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))";
  // Leap years: divisible by 4 but not by 100 (last two digits a non-zero multiple of 4), or by 400.
  // Year 0000 is left out (RFC 3339 allows it; Python's datetime, behind jsonschema's checker, does not).
  const std::string year = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])";
  const std::string leap = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)";
  return "(?:" + year + "-" + month_day + "|" + leap + "-02-29)";
}();
const std::string kTime = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])";
const std::string kOctet = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])";
const std::string kIpv4 = kOctet + "(?:\\." + kOctet + "){3}";
const std::string kIpv6 = [] {
  const std::string h = "[0-9A-Fa-f]{1,4}", ls32 = "(?:" + h + ":" + h + "|" + kIpv4 + ")";
  // (h16 ":"){n} then the rest, or up to k h16s before "::": RFC 3986's nine IPv6address forms.
  auto before = [&](int k) { return k < 0 ? std::string() : "(?:(?:" + h + ":){0," + std::to_string(k) + "}" + h + ")?"; };
  return "(?:(?:" + h + ":){6}" + ls32 + "|::(?:" + h + ":){5}" + ls32 + "|" + before(0) + "::(?:" + h + ":){4}" + ls32 + "|" +
         before(1) + "::(?:" + h + ":){3}" + ls32 + "|" + before(2) + "::(?:" + h + ":){2}" + ls32 + "|" + before(3) + "::" + h +
         ":" + ls32 + "|" + before(4) + "::" + ls32 + "|" + before(5) + "::" + h + "|" + before(6) + "::)";
}();
const std::string kLabel = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,60}[A-Za-z0-9])?";
const std::string kHostname = kLabel + "(?:\\." + kLabel + "){0,3}";
const std::string kAtext = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,20}";
const std::string kEmail = kAtext + "(?:\\." + kAtext + "){0,2}@" + kHostname;
const std::string kUri = [] {
  const std::string pct = "%[0-9A-Fa-f]{2}";
  const std::string pchar = "(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|" + pct + ")";
  const std::string authority = "(?:(?:[A-Za-z0-9._~!$&'()*+,;=:-]|" + pct + ")*@)?(?:\\[" + kIpv6 + "\\]|(?:[A-Za-z0-9._~!$&'()*+,;=-]|" +
                                pct + ")*)(?::[0-9]*)?";
  const std::string hier = "(?://" + authority + "(?:/" + pchar + "*)*|/(?:" + pchar + "+(?:/" + pchar + "*)*)?|" + pchar + "+(?:/" +
                           pchar + "*)*)?";
  return "[A-Za-z][A-Za-z0-9+.-]*:" + hier + "(?:\\?(?:" + pchar + "|[/?])*)?(?:#(?:" + pchar + "|[/?])*)?";
}();

}  // namespace

std::optional<std::string> format_regex(std::string_view f) {
  const std::string* r = f == "date"        ? &kDate
                         : f == "time"      ? &kTime
                         : f == "uuid"      ? nullptr
                         : f == "ipv4"      ? &kIpv4
                         : f == "ipv6"      ? &kIpv6
                         : f == "hostname"  ? &kHostname
                         : f == "email"     ? &kEmail
                         : f == "uri"       ? &kUri
                                            : nullptr;
  if (f == "date-time") return "^" + kDate + "T" + kTime + "$";
  if (f == "uuid") return std::string("^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$");
  if (!r) return std::nullopt;
  return "^" + *r + "$";
}

const char* supported_formats() { return "date, time, date-time, uuid, ipv4, ipv6, hostname, email, uri"; }

}  // namespace kd::grammar
