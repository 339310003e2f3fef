#include "client/command_line.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace bertshard::client {
namespace {

const Flag kHelp = {"help", "", "print this help and exit"};

// The flag called `name` (its own name or an alias), or nullptr.
const Flag* FindFlag(const std::vector<Flag>& flags, const std::string& name) {
  if (name == kHelp.name) return &kHelp;
  for (const Flag& f : flags) {
    if (f.name == name || std::find(f.aliases.begin(), f.aliases.end(), name) != f.aliases.end()) return &f;
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args, const std::vector<Flag>& flags) {
  CommandLine cl;
  std::set<std::string> seen;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      cl.positional.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    const Flag* flag = FindFlag(flags, name);
    if (flag == nullptr) {
      std::vector<std::string> known;
      for (const Flag& f : flags) known.push_back("--" + f.name);
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, "; known flags: ", absl::StrJoin(known, " ")));
    }
    if (!seen.insert(flag->name).second) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag->name, " is given more than once"));
    }
    if (!flag->value_name.empty()) {
      if (!has_value) {
        if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        value = args[++i];
      }
      cl.values[flag->name] = value;
    } else if (!has_value || value == "true") {
      cl.switches.insert(flag->name);
    } else if (value != "false") {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " is a switch: give it alone, or =true / =false"));
    }
  }
  return cl;
}

std::string FormatFlagHelp(const std::vector<Flag>& flags) {
  constexpr size_t kColumn = 28;  // where the help starts
  std::string text;
  for (const Flag& f : flags) {
    std::string names = absl::StrCat("  --", f.name, f.value_name.empty() ? "" : " ", f.value_name);
    for (const std::string& alias : f.aliases) absl::StrAppend(&names, ", --", alias);
    const std::string indent(kColumn, ' ');
    if (names.size() + 2 > kColumn) {  // at least two spaces between a flag and its help
      absl::StrAppend(&text, names, "\n", indent);
    } else {
      absl::StrAppend(&text, names, std::string(kColumn - names.size(), ' '));
    }
    absl::StrAppend(&text, absl::StrReplaceAll(f.help, {{"\n", "\n" + indent}}), "\n");
  }
  return text;
}

std::vector<Flag> JoinFlags(std::initializer_list<std::vector<Flag>> parts) {
  std::vector<Flag> flags;
  for (const std::vector<Flag>& part : parts) flags.insert(flags.end(), part.begin(), part.end());
  return flags;
}

std::vector<Flag> SelectFlags(std::vector<Flag> flags, const std::set<std::string>& names) {
  flags.erase(std::remove_if(flags.begin(), flags.end(), [&](const Flag& f) { return names.count(f.name) == 0; }),
              flags.end());
  return flags;
}

}  // namespace bertshard::client
