#include "client/command_line.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace bertshard::client {

absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args,
                                             const std::set<std::string>& value_flags,
                                             const std::set<std::string>& switch_flags) {
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
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " is given more than once"));
    }
    if (value_flags.count(name)) {
      if (!has_value) {
        if (i + 1 >= args.size()) {
          return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        }
        value = args[++i];
      }
      cl.values[name] = value;
    } else if (switch_flags.count(name)) {
      if (!has_value || value == "true") {
        cl.switches.insert(name);
      } else if (value != "false") {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " is a switch: give it alone, or =true / =false"));
      }
    } else {
      std::vector<std::string> known;
      for (const auto& f : value_flags) known.push_back("--" + f);
      for (const auto& f : switch_flags) known.push_back("--" + f);
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, "; known flags: ", absl::StrJoin(known, " ")));
    }
  }
  return cl;
}

}  // namespace bertshard::client
