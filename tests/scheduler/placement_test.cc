// ExpertPlacement: even and uneven splits, owners, and invalid requests.
#include <gtest/gtest.h>

#include "scheduler/placement.h"

namespace strata::scheduler {
namespace {

TEST(PlacementTest, EvenSplitGivesRemainderToFirstWorkers) {
  auto p = ExpertPlacement::Even(10, 4);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->workers(), 4);
  EXPECT_EQ(p->num_experts(), 10);
  const int64_t counts[] = {3, 3, 2, 2};
  int64_t next = 0;
  for (int w = 0; w < 4; ++w) {
    EXPECT_EQ(p->count(w), counts[w]);
    EXPECT_EQ(p->first(w), next);
    for (int64_t e = next; e < next + counts[w]; ++e) EXPECT_EQ(p->Owner(e), w);
    next += counts[w];
  }
  EXPECT_EQ(p->ToString(), "w0:[0,3) w1:[3,6) w2:[6,8) w3:[8,10)");
}

TEST(PlacementTest, UnevenWithEmptyWorkers) {
  auto p = ExpertPlacement::FromCounts({0, 5, 0, 3});
  ASSERT_TRUE(p.ok());
  for (int64_t e = 0; e < 5; ++e) EXPECT_EQ(p->Owner(e), 1);
  for (int64_t e = 5; e < 8; ++e) EXPECT_EQ(p->Owner(e), 3);
  auto more_workers = ExpertPlacement::Even(2, 4);
  ASSERT_TRUE(more_workers.ok());
  EXPECT_EQ(more_workers->count(3), 0);
  EXPECT_EQ(more_workers->Owner(1), 1);
}

TEST(PlacementTest, InvalidRequestsAreErrors) {
  EXPECT_FALSE(ExpertPlacement::Even(0, 2).ok());
  EXPECT_FALSE(ExpertPlacement::Even(4, 0).ok());
  EXPECT_FALSE(ExpertPlacement::FromCounts({}).ok());
  EXPECT_FALSE(ExpertPlacement::FromCounts({2, -1}).ok());
  EXPECT_FALSE(ExpertPlacement::FromCounts({0, 0}).ok());
}

}  // namespace
}  // namespace strata::scheduler
