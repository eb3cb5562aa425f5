#include "launcher/job_config.h"

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/message_differencer.h>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace strata::launcher {

namespace {

using google::protobuf::util::MessageDifferencer;

// Collects one line per differing leaf field.
class Lines : public MessageDifferencer::Reporter {
 public:
  explicit Lines(std::vector<std::string>* out) : out_(out) {}
  void ReportAdded(const google::protobuf::Message&, const google::protobuf::Message& mine,
                   const std::vector<MessageDifferencer::SpecificField>& path) override {
    Add(path, "(not set)", Value(mine, path));
  }
  void ReportDeleted(const google::protobuf::Message& job, const google::protobuf::Message&,
                     const std::vector<MessageDifferencer::SpecificField>& path) override {
    Add(path, Value(job, path), "(not set)");
  }
  void ReportModified(const google::protobuf::Message& job, const google::protobuf::Message& mine,
                      const std::vector<MessageDifferencer::SpecificField>& path) override {
    const auto& last = path.back();
    if (last.field != nullptr &&
        last.field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
      return;  // its differing leaves are reported on their own
    }
    Add(path, Value(job, path), Value(mine, path));
  }

 private:
  static std::string Name(const std::vector<MessageDifferencer::SpecificField>& path) {
    std::vector<std::string> parts;
    for (const auto& f : path) {
      if (f.field == nullptr) continue;
      std::string p = f.field->name();
      if (f.field->is_repeated() && f.index >= 0) absl::StrAppendFormat(&p, "[%d]", f.index);
      parts.push_back(p);
    }
    return absl::StrJoin(parts, ".");
  }
  // The value at `path` in `root`, in text format.
  static std::string Value(const google::protobuf::Message& root,
                           const std::vector<MessageDifferencer::SpecificField>& path) {
    // The reporter is handed the messages that hold the differing field's outermost path element
    // that is still inside them: start the walk there.
    const google::protobuf::Message* m = &root;
    size_t start = 0;
    for (size_t i = 0; i < path.size(); ++i) {
      if (path[i].field != nullptr && path[i].field->containing_type() == root.GetDescriptor()) {
        start = i;
      }
    }
    for (size_t i = start; i + 1 < path.size(); ++i) {
      const auto& f = path[i];
      const auto* r = m->GetReflection();
      if (f.field->is_repeated()) {
        if (f.index < 0 || f.index >= r->FieldSize(*m, f.field)) return "?";
        m = &r->GetRepeatedMessage(*m, f.field, f.index);
      } else {
        m = &r->GetMessage(*m, f.field);
      }
    }
    const auto& leaf = path.back();
    std::string out;
    if (leaf.field == nullptr) return "?";
    const int index = leaf.field->is_repeated() ? leaf.index : -1;
    if (leaf.field->is_repeated() &&
        (index < 0 || index >= m->GetReflection()->FieldSize(*m, leaf.field))) {
      return "(not set)";
    }
    google::protobuf::TextFormat::PrintFieldValueToString(*m, leaf.field, index, &out);
    return out;
  }
  void Add(const std::vector<MessageDifferencer::SpecificField>& path, const std::string& job,
           const std::string& mine) {
    out_->push_back(absl::StrFormat("%s: %s (job) vs %s (this worker)", Name(path), job, mine));
  }
  std::vector<std::string>* out_;
};

// Parses without logging: a joiner's bad text is the joiner's error, reported to it.
bool ParseQuietly(const std::string& text, config::JobConfig* out) {
  class Silent : public google::protobuf::io::ErrorCollector {
   public:
    void AddError(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
  };
  Silent silent;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&silent);
  return parser.ParseFromString(text, out);
}

}  // namespace

void ClearMachineFields(config::JobConfig* config) {
  config->mutable_train()->clear_threads();
  config->mutable_train()->clear_device();
  config->mutable_data()->clear_path();
  config->mutable_storage()->clear_ssd_dir();
}

config::JobConfig JobPart(const config::JobConfig& config) {
  config::JobConfig c = config;
  ClearMachineFields(&c);
  return c;
}

std::vector<std::string> JobDifferences(const config::JobConfig& job,
                                        const config::JobConfig& mine) {
  const config::JobConfig a = JobPart(job), b = JobPart(mine);
  std::vector<std::string> lines;
  Lines reporter(&lines);
  MessageDifferencer d;
  // A field left out means its default: `lr: 0.001` written out equals no `lr` at all.
  d.set_message_field_comparison(MessageDifferencer::EQUIVALENT);
  d.set_repeated_field_comparison(MessageDifferencer::AS_LIST);
  d.ReportDifferencesTo(&reporter);
  d.Compare(a, b);
  return lines;
}

Status CheckJoinerConfig(const std::string& job_text, const std::string& worker_id,
                         const std::string& worker_text) {
  if (worker_text.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "worker '%s' did not say which config it trains with; a worker of this strata gets the "
        "job's config from the coordinator (start it with `strata worker --coordinator HOST:PORT`)",
        worker_id));
  }
  config::JobConfig job, mine;
  if (!ParseQuietly(job_text, &job)) {
    return absl::InternalError("the coordinator's record holds a job config that does not parse");
  }
  if (!ParseQuietly(worker_text, &mine)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "worker '%s' sent a job config that does not parse as a strata JobConfig", worker_id));
  }
  const std::vector<std::string> diff = JobDifferences(job, mine);
  if (diff.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "worker '%s' trains with another config than the job's; it was not admitted. Differences:\n"
      "  %s\nStart it without --config to train with the job's config, or fix its config file",
      worker_id, absl::StrJoin(diff, "\n  ")));
}

}  // namespace strata::launcher
